-- One row per (consumer, event) whose effect has been applied. The primary
-- key is what makes a second delivery wait for the first and then see the
-- conflict; processed_at drives the retention cleaner.
CREATE TABLE millwright_processed_events (
    consumer     TEXT        NOT NULL,
    event_id     TEXT        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX millwright_processed_events_processed_at_idx
    ON millwright_processed_events (processed_at);
