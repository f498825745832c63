-- curfew store, version 4: tenants' API keys (issue 9). Only a hash of each key's secret
-- is kept; the id is the key's public part, so a presented key is found by it.
CREATE TABLE api_keys (
    id         TEXT PRIMARY KEY,
    tenant     TEXT NOT NULL,
    hash       BLOB NOT NULL,
    created_ms BIGINT NOT NULL,
    revoked_ms BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX api_keys_tenant ON api_keys (tenant, created_ms);
-- One row per tenant with keys: a rotation locks it first, so that two rotations of one
-- tenant at once leave exactly one valid key (on PostgreSQL; SQLite's write transactions
-- are serial anyway).
CREATE TABLE api_key_tenants (
    tenant TEXT PRIMARY KEY
);
