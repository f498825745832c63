-- curfew store, version 10: cluster-wide admission slots (issue 24, docs/cluster.md).
-- A scope ("pool/paid", "tenant/acme") has size slots numbered 0..size-1, pre-inserted
-- rows that a replica claims with one conditional UPDATE and holds under a TTL it
-- renews: a cap holds across replicas because a row is held by one holder at a time,
-- never because someone counted. Rows are never deleted: a shrink leaves the slots at
-- or above the new size in place, inactive (never claimed again, but a holder keeps
-- one until it releases it), so an epoch never restarts and a stale holder's release
-- cannot free a slot someone claimed after a shrink and a grow.
CREATE TABLE slot_scopes (
    scope TEXT PRIMARY KEY,
    size  INTEGER NOT NULL
);
CREATE TABLE slots (
    scope      TEXT NOT NULL,
    n          INTEGER NOT NULL,
    holder     TEXT NOT NULL DEFAULT '',   -- '' while free
    epoch      BIGINT NOT NULL DEFAULT 0,  -- +1 on every claim: the fencing token
    expires_ms BIGINT NOT NULL DEFAULT 0,  -- the holder's TTL, by the store's clock
    PRIMARY KEY (scope, n)
);
-- RenewSlots finds a holder's slots.
CREATE INDEX slots_holder ON slots (holder) WHERE holder <> '';

-- A release (a holder giving a slot back) notifies the channel curfew_slots with the
-- scope, so that replicas waiting for a slot claim at once instead of at their next
-- poll (store.SlotReleases). A hint only: a slot that frees by expiry sends nothing.
CREATE FUNCTION curfew_slot_released() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('curfew_slots', NEW.scope);
    RETURN NULL;
END
$$;
CREATE TRIGGER slots_released AFTER UPDATE ON slots FOR EACH ROW
    WHEN (OLD.holder <> '' AND NEW.holder = '') EXECUTE FUNCTION curfew_slot_released();
