-- curfew store, version 2: a finished run's summary (the orchestrator's Run message with
-- its node tree, protobuf-encoded), so that any orchestrator can serve it after a restart.
ALTER TABLE runs ADD COLUMN summary BYTEA NOT NULL DEFAULT ''::bytea;
