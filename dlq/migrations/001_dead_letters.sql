-- Dead letters recorded by dlq.Store.Record from the dead-letter topics, for
-- inspection and replay. One row per dead-lettering of a message: a message
-- replayed and dead-lettered again gets a second row (a new last failure);
-- a redelivered dead letter does not (the unique key).
CREATE TABLE millwright_dead_letters (
    id               BIGSERIAL PRIMARY KEY,
    message_uuid     TEXT        NOT NULL,
    original_topic   TEXT        NOT NULL,
    dlq_topic        TEXT        NOT NULL,
    consumer_group   TEXT        NOT NULL DEFAULT '',
    handler          TEXT        NOT NULL DEFAULT '',
    reason           TEXT        NOT NULL DEFAULT '',
    error            TEXT        NOT NULL DEFAULT '',
    error_type       TEXT        NOT NULL DEFAULT '',
    stack            TEXT        NOT NULL DEFAULT '',
    attempts         INTEGER     NOT NULL DEFAULT 0,
    first_failure_at TIMESTAMPTZ NOT NULL,
    last_failure_at  TIMESTAMPTZ NOT NULL,
    payload          BYTEA       NOT NULL,
    -- The original message's metadata, without the dlq_* keys (those are
    -- the columns above): what replay publishes.
    metadata         JSONB       NOT NULL DEFAULT '{}',
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    replayed_at      TIMESTAMPTZ,
    replay_count     INTEGER     NOT NULL DEFAULT 0,
    UNIQUE (dlq_topic, message_uuid, last_failure_at)
);

CREATE INDEX millwright_dead_letters_topic_created_idx
    ON millwright_dead_letters (original_topic, created_at);

-- The depth gauge and the default replay read only rows not yet replayed.
CREATE INDEX millwright_dead_letters_pending_idx
    ON millwright_dead_letters (original_topic) WHERE replayed_at IS NULL;
