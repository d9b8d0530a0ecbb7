-- A dead letter whose message was applied later through package park
-- (`millwright parked retry` ran it again and it succeeded, or a replay
-- took its place at its key's head) is resolved: it leaves the dead ones
-- (`millwright dlq list`, the console, millwright_dlq_depth_messages) and
-- is not replayed by default. dlq.ResolveTx moves it, from 'dead' only, in
-- the transaction that applied the message, with an audit row.
ALTER TABLE millwright_dead_letters DROP CONSTRAINT millwright_dead_letters_state_check,
    ADD CONSTRAINT millwright_dead_letters_state_check CHECK (state IN ('dead', 'replayed', 'superseded', 'resolved')),
    ADD COLUMN resolved_at TIMESTAMPTZ,
    ADD COLUMN resolved_by TEXT NOT NULL DEFAULT '';

-- The depth (millwright_dlq_depth_messages) counts the dead ones by topic.
CREATE INDEX millwright_dead_letters_dead_idx ON millwright_dead_letters (original_topic) WHERE state = 'dead';
