-- curfew store, version 7: the configuration version each replica runs (issue 22), one
-- row per service, replica and configuration file, so that an operator asking any
-- replica sees every replica's. seen_ms is refreshed periodically: a replica that stopped
-- refreshing is gone.
CREATE TABLE replica_configs (
    service       TEXT NOT NULL,
    replica       TEXT NOT NULL,
    config        TEXT NOT NULL,
    version       TEXT NOT NULL,
    loaded_ms     BIGINT NOT NULL DEFAULT 0,
    last_error    TEXT NOT NULL DEFAULT '',
    last_error_ms BIGINT NOT NULL DEFAULT 0,
    seen_ms       BIGINT NOT NULL,
    PRIMARY KEY (service, replica, config)
);
CREATE INDEX replica_configs_seen ON replica_configs (seen_ms);
