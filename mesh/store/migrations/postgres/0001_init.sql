-- curfew store, version 1. Times are Unix milliseconds (BIGINT, 0 = unset) so that both
-- backends compare them the same way and tests can inject the clock.

CREATE TABLE runs (
    run_id           TEXT PRIMARY KEY,          -- UUIDv7: sorts by creation
    tenant           TEXT NOT NULL,
    idempotency_key  TEXT,                      -- NULL: none; unique per tenant
    task             BYTEA NOT NULL,
    model            TEXT NOT NULL DEFAULT '',
    deadline_ms      BIGINT NOT NULL,
    status           TEXT NOT NULL,
    cause            TEXT NOT NULL DEFAULT '',
    error            TEXT NOT NULL DEFAULT '',
    answer           BYTEA NOT NULL DEFAULT ''::bytea,
    created_ms       BIGINT NOT NULL,
    ended_ms         BIGINT NOT NULL DEFAULT 0,
    owner            TEXT NOT NULL DEFAULT '',
    epoch            BIGINT NOT NULL DEFAULT 0,
    lease_expires_ms BIGINT NOT NULL DEFAULT 0,
    UNIQUE (tenant, idempotency_key)
);
CREATE INDEX runs_tenant_id ON runs (tenant, run_id);
CREATE INDEX runs_claimable ON runs (lease_expires_ms) WHERE ended_ms = 0;

CREATE TABLE checkpoints (
    run_id       TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    step         INTEGER NOT NULL,
    tenant       TEXT NOT NULL,
    epoch        BIGINT NOT NULL,              -- the writer's epoch
    model_output BYTEA NOT NULL,
    tool_results BYTEA NOT NULL,
    tokens       BIGINT NOT NULL DEFAULT 0,
    created_ms   BIGINT NOT NULL,
    PRIMARY KEY (run_id, step)
);

CREATE TABLE tool_records (
    tenant           TEXT NOT NULL,
    tool_key         TEXT NOT NULL,
    run_id           TEXT NOT NULL DEFAULT '',
    tool             TEXT NOT NULL DEFAULT '',
    status           TEXT NOT NULL,            -- in_progress | done | failed
    owner            TEXT NOT NULL DEFAULT '',
    epoch            BIGINT NOT NULL,
    lease_expires_ms BIGINT NOT NULL DEFAULT 0,
    result           BYTEA NOT NULL DEFAULT ''::bytea,
    error_type       TEXT NOT NULL DEFAULT '',
    error            TEXT NOT NULL DEFAULT '',
    created_ms       BIGINT NOT NULL,
    updated_ms       BIGINT NOT NULL,
    PRIMARY KEY (tenant, tool_key)
);

CREATE TABLE kv (
    tenant          TEXT NOT NULL,
    kv_key          TEXT NOT NULL,
    value           BYTEA NOT NULL,
    version         BIGINT NOT NULL,           -- writes that took effect
    idempotency_key TEXT NOT NULL,             -- the tool call that wrote it last
    updated_ms      BIGINT NOT NULL,
    PRIMARY KEY (tenant, kv_key)
);

CREATE TABLE outbox (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant          TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    channel         TEXT NOT NULL,
    payload         BYTEA NOT NULL,
    created_ms      BIGINT NOT NULL,
    UNIQUE (tenant, idempotency_key, seq)
);
CREATE INDEX outbox_tenant_id ON outbox (tenant, id);

CREATE TABLE dead_letters (
    id              TEXT PRIMARY KEY,          -- UUIDv7
    tenant          TEXT NOT NULL,
    run_id          TEXT NOT NULL,
    step            TEXT NOT NULL,
    error_type      TEXT NOT NULL DEFAULT '',
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT NOT NULL DEFAULT '',
    payload         BYTEA NOT NULL DEFAULT ''::bytea,
    idempotency_key TEXT NOT NULL DEFAULT '',
    created_ms      BIGINT NOT NULL,
    replayed_ms     BIGINT NOT NULL DEFAULT 0,
    replay_count    INTEGER NOT NULL DEFAULT 0,
    UNIQUE (tenant, run_id, step)
);
CREATE INDEX dead_letters_open ON dead_letters (tenant) WHERE replayed_ms = 0;

CREATE TABLE token_ledger (
    id        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant    TEXT NOT NULL,
    run_id    TEXT NOT NULL,
    node_id   TEXT NOT NULL DEFAULT '',
    tokens    BIGINT NOT NULL,
    kind      TEXT NOT NULL DEFAULT '',
    entry_key TEXT,                            -- NULL: not deduplicated
    at_ms     BIGINT NOT NULL,
    UNIQUE (tenant, entry_key)
);
CREATE INDEX token_ledger_run ON token_ledger (tenant, run_id);
