-- curfew store, version 5: a run's input beyond its task and model (the orchestrator's
-- RunInput message, protobuf-encoded; empty for a run started with a task alone), so a
-- run taken over or replayed resumes with it, and an idempotency key compares it.
ALTER TABLE runs ADD COLUMN input BYTEA NOT NULL DEFAULT ''::bytea;
