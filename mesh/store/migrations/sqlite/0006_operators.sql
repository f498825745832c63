-- curfew store, version 6: operators' state (issue 22). What an operator decides (a closed
-- pool, a frozen ledger, a decoder drain) is a row here, so a command sent to one replica
-- holds on all of them; every call that changes something is in the audit log; keys
-- carry operator scopes; runs record who started them; sheds are counted per tenant.
CREATE TABLE operator_controls (
    kind       TEXT NOT NULL,
    target     TEXT NOT NULL,
    tenant     TEXT NOT NULL DEFAULT '',
    reason     TEXT NOT NULL DEFAULT '',
    actor      TEXT NOT NULL DEFAULT '',
    created_ms BIGINT NOT NULL,
    until_ms   BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (kind, target)
);
CREATE TABLE audit_log (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms   BIGINT NOT NULL,
    actor   TEXT NOT NULL,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL DEFAULT '',
    reason  TEXT NOT NULL DEFAULT '',
    request TEXT NOT NULL DEFAULT ''
);
CREATE INDEX audit_log_at ON audit_log (at_ms);
-- Comma-separated operator scopes (admin, read-only); '' for a tenant's ordinary key.
ALTER TABLE api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT '';
-- Who started the run: "key:<id>" or "mesh:<identity>".
ALTER TABLE runs ADD COLUMN started_by TEXT NOT NULL DEFAULT '';
-- Sheds per tenant and minute, for curfew usage.
CREATE TABLE tenant_sheds (
    tenant    TEXT NOT NULL,
    minute_ms BIGINT NOT NULL,
    sheds     BIGINT NOT NULL,
    PRIMARY KEY (tenant, minute_ms)
);
-- The orphan delta and usage windows read the ledger by time.
CREATE INDEX token_ledger_at ON token_ledger (at_ms);
CREATE INDEX runs_tenant_created ON runs (tenant, created_ms);
