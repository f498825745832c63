-- curfew store, version 11: token budgets reserved across replicas (issue 24,
-- docs/cluster.md "Budgets across replicas"). One row per tenant holds its current
-- window's settled spend and the sum of its live reservations; each reservation is
-- also a row of its own, with its holder (one per modelproxy process) and an expiry
-- the holder renews, so that a crashed replica's reservations stop counting after
-- their TTL. A reservation is granted by one conditional upsert of the tenant's row
-- (spent + reserved + n <= budget, judged on the latest row under its lock), never
-- counted and then inserted, so READ COMMITTED cannot overshoot; the invariant is
-- budget_tenants.reserved = SUM(budget_holds.tokens) of the tenant, kept by every
-- statement that inserts or deletes a hold.
CREATE TABLE budget_tenants (
    tenant    TEXT PRIMARY KEY,
    window_ms BIGINT NOT NULL,            -- the window's length
    start_ms  BIGINT NOT NULL,            -- the current window's start (epoch-aligned)
    spent     BIGINT NOT NULL DEFAULT 0,  -- settled in the current window
    reserved  BIGINT NOT NULL DEFAULT 0,  -- SUM(tokens) of the tenant's budget_holds
    granted   INTEGER NOT NULL DEFAULT 0  -- the last reservation's outcome, for RETURNING
);
CREATE TABLE budget_holds (
    id         TEXT PRIMARY KEY,
    tenant     TEXT NOT NULL,
    holder     TEXT NOT NULL,
    tokens     BIGINT NOT NULL,
    expires_ms BIGINT NOT NULL            -- by the store's clock; renewed by the holder
);
-- A reservation sweeps its tenant's expired holds; a renewal finds a holder's.
CREATE INDEX budget_holds_tenant ON budget_holds (tenant, expires_ms);
CREATE INDEX budget_holds_holder ON budget_holds (holder);
