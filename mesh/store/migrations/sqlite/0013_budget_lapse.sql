-- curfew store, version 13: a reservation whose holder never settles it (a crashed
-- modelproxy) is charged what the token ledger recorded of its call when it lapses
-- (issue 26 item 4, docs/cluster.md "When a replica crashes"). A hold names its call's
-- decoder in the ledger: run_id and ledger_key, whose parts are the token_ledger rows of
-- run_id keyed ledger_key/<k>… ('' names none: nothing is charged). A lapsed hold is not
-- deleted at once but kept as a tombstone (lapsed_ms > 0, tokens 0, charged the ledger's
-- sum), so that a late settlement of the same hold charges only what the lapse did not:
-- settle and lapse each charge a call once, whichever comes first. Tombstones go once
-- their expiry passes (store.LapsedHoldKeep after the lapse or the holder's last
-- renewal). Additive: a binary of version 12 sees a tombstone as a hold of 0 tokens.
ALTER TABLE budget_holds ADD COLUMN run_id TEXT NOT NULL DEFAULT '';
ALTER TABLE budget_holds ADD COLUMN ledger_key TEXT NOT NULL DEFAULT '';
ALTER TABLE budget_holds ADD COLUMN lapsed_ms BIGINT NOT NULL DEFAULT 0;
ALTER TABLE budget_holds ADD COLUMN charged BIGINT NOT NULL DEFAULT 0;
