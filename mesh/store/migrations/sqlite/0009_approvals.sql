-- curfew store, version 9: approval gates (issue 22). One row per tool call that waits
-- for a human, keyed by tenant, run, node and idempotency key, so that a call re-sent
-- after a takeover finds the request it made before. The first decision stands.
CREATE TABLE approvals (
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    node_id      TEXT NOT NULL,
    idem_key     TEXT NOT NULL,
    tool         TEXT NOT NULL,
    args         TEXT NOT NULL DEFAULT '',
    why          TEXT NOT NULL DEFAULT '',
    state        TEXT NOT NULL,
    requested_ms BIGINT NOT NULL,
    expires_ms   BIGINT NOT NULL DEFAULT 0,
    decided_by   TEXT NOT NULL DEFAULT '',
    decided_ms   BIGINT NOT NULL DEFAULT 0,
    reason       TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (tenant, run_id, node_id, idem_key)
);
CREATE INDEX approvals_state ON approvals (state, requested_ms);
CREATE INDEX approvals_run ON approvals (run_id, node_id);
