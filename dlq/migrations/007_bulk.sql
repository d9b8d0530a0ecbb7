-- Bulk actions over a filter (the console's "every dead letter matching
-- this filter"): one row per action, its filter, the id bound its dry run
-- saw, and a cursor advanced in the transaction of each batch, so that an
-- interrupted run continues where it stopped and never handles a row
-- twice. A discarded dead letter was given up on by an operator: it
-- leaves the dead ones and is never replayed, not even forced.
CREATE TABLE millwright_dlq_bulk (
    id          BIGSERIAL PRIMARY KEY,
    action      TEXT NOT NULL CHECK (action IN ('replay', 'discard')),
    filter      JSONB NOT NULL,
    max_id      BIGINT NOT NULL,
    cap         INT NOT NULL,
    planned     INT NOT NULL,
    cursor_id   BIGINT NOT NULL DEFAULT 0,
    done        INT NOT NULL DEFAULT 0,
    skipped     INT NOT NULL DEFAULT 0,
    state       TEXT NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'done', 'failed')),
    created_by  TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    error       TEXT NOT NULL DEFAULT ''
);

ALTER TABLE millwright_dead_letters DROP CONSTRAINT millwright_dead_letters_state_check,
    ADD CONSTRAINT millwright_dead_letters_state_check CHECK (state IN ('dead', 'replayed', 'superseded', 'resolved', 'discarded'));
