-- Edit and replay (the operator console): an edited copy of a dead letter
-- replaces it. state says what became of a row:
--   dead        not replayed yet (replayed_at IS NULL);
--   replayed    published again as it was (dlq.Store.Replay, the console);
--   superseded  replaced by an edited copy, queued through the outbox in
--               the transaction that set this state (superseded_by is the
--               copy's event id); never replayed again, even with --force.
-- Both ways out of 'dead' are conditional updates of one row (WHERE state =
-- 'dead', or the replay's row lock), so of an edit and a replay, or of two
-- edits, racing on one row exactly one wins.
ALTER TABLE millwright_dead_letters
    ADD COLUMN state TEXT NOT NULL DEFAULT 'dead'
        CONSTRAINT millwright_dead_letters_state_check CHECK (state IN ('dead', 'replayed', 'superseded')),
    ADD COLUMN superseded_at TIMESTAMPTZ,
    ADD COLUMN superseded_by TEXT NOT NULL DEFAULT '',
    ADD COLUMN superseded_actor TEXT NOT NULL DEFAULT '';

UPDATE millwright_dead_letters SET state = 'replayed' WHERE replayed_at IS NOT NULL;
