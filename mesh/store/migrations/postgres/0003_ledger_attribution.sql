-- curfew store, version 3: a ledger entry names the retry-id and the provider its tokens
-- belong to, beside tenant, run and node (issue 6: tokens are attributed to the task,
-- tenant, retry-id and provider, never to a worker or host).
ALTER TABLE token_ledger ADD COLUMN retry_id TEXT NOT NULL DEFAULT '';
ALTER TABLE token_ledger ADD COLUMN provider TEXT NOT NULL DEFAULT '';
