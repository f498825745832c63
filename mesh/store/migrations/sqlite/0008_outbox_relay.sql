-- curfew store, version 8: the outbox relay (issue 22, docs/outbox.md). Each notify gets
-- its position on its (tenant, channel), assigned under the channel's row lock in the
-- writer's transaction, so positions are gap-free and in commit order; the channel's row
-- also keeps the relay's cursor: how far it was published to JetStream, and the stream
-- sequence and message id of the last published message, which the relay checks the
-- stream against before its next publish on that subject.
ALTER TABLE outbox ADD COLUMN channel_seq BIGINT NOT NULL DEFAULT 0;
-- Rows written before this version: positions in id order.
UPDATE outbox SET channel_seq = (SELECT COUNT(*) FROM outbox o2
    WHERE o2.tenant = outbox.tenant AND o2.channel = outbox.channel AND o2.id <= outbox.id);
-- Partial: a row written by an older binary during a rolling upgrade has channel_seq 0.
CREATE UNIQUE INDEX outbox_channel_seq ON outbox (tenant, channel, channel_seq) WHERE channel_seq > 0;

CREATE TABLE outbox_channels (
    tenant      TEXT NOT NULL,
    channel     TEXT NOT NULL,
    written_seq BIGINT NOT NULL,               -- the channel_seq of its last row
    relayed_seq BIGINT NOT NULL DEFAULT 0,     -- the channel_seq of its last published row
    stream_seq  BIGINT NOT NULL DEFAULT 0,     -- that message's JetStream stream sequence
    relayed_key TEXT NOT NULL DEFAULT '',      -- that message's Nats-Msg-Id
    relayed_ms  BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, channel)
);
INSERT INTO outbox_channels (tenant, channel, written_seq)
    SELECT tenant, channel, MAX(channel_seq) FROM outbox GROUP BY tenant, channel;
CREATE INDEX outbox_channels_pending ON outbox_channels (tenant, channel) WHERE written_seq > relayed_seq;

-- The relay's lease: one row, one relay at a time across replicas, fenced by its epoch.
CREATE TABLE outbox_relay (
    name             TEXT PRIMARY KEY,
    owner            TEXT NOT NULL DEFAULT '',
    epoch            BIGINT NOT NULL DEFAULT 0,
    lease_expires_ms BIGINT NOT NULL DEFAULT 0
);
INSERT INTO outbox_relay (name) VALUES ('outbox');
