-- Parked keys (park.Parker): one row per (handler, key) whose messages wait
-- in millwright_parked_messages for the retrier. The row is the key's lock:
-- the middleware parking a message behind the key and the retrier releasing
-- the key both lock it, so a key is released only when no message of it is
-- parked, and a message arriving meanwhile either sees the row (and is
-- parked behind) or sees it gone (every earlier message of its key done).
CREATE TABLE millwright_parked_keys (
    handler          TEXT        NOT NULL,
    key              TEXT        NOT NULL,
    -- When the head message is retried next; moved forward by a lease
    -- while a retrier runs it, so a retrier that dies leaves the key due
    -- again once its lease has passed.
    due_at           TIMESTAMPTZ NOT NULL,
    -- The head was dead-lettered under the hold policy: nothing of the key
    -- runs until an operator releases or retries it.
    held             BOOLEAN     NOT NULL DEFAULT false,
    -- Bumped by every claim: a retrier whose lease was taken over sees its
    -- claim number gone and writes nothing.
    claims           BIGINT      NOT NULL DEFAULT 0,
    -- The head message's attempts so far (the in-place ones included), the
    -- retrier's rounds on it (what the park policy counts), its previous
    -- jittered delay (for decorrelated jitter), its failures.
    attempts         INTEGER     NOT NULL DEFAULT 0,
    rounds           INTEGER     NOT NULL DEFAULT 0,
    prev_delay_ms    BIGINT      NOT NULL DEFAULT 0,
    first_failure_at TIMESTAMPTZ,
    last_failure_at  TIMESTAMPTZ,
    last_error       TEXT        NOT NULL DEFAULT '',
    -- The dead letter of a held head (millwright_dead_letters.id).
    dead_letter_id   BIGINT,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, key)
);

-- The retrier's claim reads due keys that are not held.
CREATE INDEX millwright_parked_keys_due_idx ON millwright_parked_keys (due_at) WHERE NOT held;

-- The parked messages, in their key's order (id, assigned while the key's
-- row is locked).
CREATE TABLE millwright_parked_messages (
    id           BIGSERIAL   PRIMARY KEY,
    handler      TEXT        NOT NULL,
    key          TEXT        NOT NULL,
    message_uuid TEXT        NOT NULL,
    topic        TEXT        NOT NULL DEFAULT '',
    payload      BYTEA       NOT NULL,
    metadata     JSONB       NOT NULL DEFAULT '{}',
    parked_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- A redelivered message (its ack lost after it was parked) is parked once.
    UNIQUE (handler, message_uuid),
    FOREIGN KEY (handler, key) REFERENCES millwright_parked_keys (handler, key) ON DELETE CASCADE
);

CREATE INDEX millwright_parked_messages_key_idx ON millwright_parked_messages (handler, key, id);
