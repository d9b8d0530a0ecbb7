-- Keys, message UUIDs and metadata as bytes (issue 40). A Kafka key or a
-- header is bytes; stored as text, its invalid UTF-8 was replaced with
-- U+FFFD, so distinct binary keys (0aff01, 0afe01) shared one parked key
-- and a retried message reached its handler with other metadata.
--
-- key is now the key's lane: one tag byte, then bytes.
--   'k' || the key's bytes           a message's key (Config.Key);
--   'u' || the message's UUID bytes  a message without a key, parked alone.
-- The tag keeps a keyless lane apart from a real key of any value (the
-- text "uuid:<UUID>" used to be both).
--
-- metadata is the message's metadata, byte for byte: for each entry, its
-- key's length (4 bytes, big endian), the key, its value's length, the
-- value (storage.EncodeParkedMetadata).
--
-- Instances of an older millwright still running after this migration
-- cannot park (their statements write text and JSON): they nack, and the
-- broker redelivers to the upgraded ones. Nothing is lost; deploy the new
-- version with or right after the migration.
--
-- dead_letter_id on a message is the dead letter recorded for it (its key
-- held behind it); when the message is applied later (`millwright parked
-- retry`, a replay taking its place) the dead letter is resolved.

ALTER TABLE millwright_parked_messages DROP CONSTRAINT millwright_parked_messages_handler_key_fkey;
-- The keys are rewritten in place with a tag: "foo" becomes "kfoo" while
-- a real key "kfoo" may still be there, untagged. The primary key, checked
-- row by row, would refuse that; it comes back once every key is tagged
-- (the tagged keys are unique: the tag is one byte before distinct keys).
ALTER TABLE millwright_parked_keys DROP CONSTRAINT millwright_parked_keys_pkey;

ALTER TABLE millwright_parked_keys ALTER COLUMN key TYPE BYTEA USING convert_to(key, 'UTF8');
ALTER TABLE millwright_parked_messages
    ALTER COLUMN key TYPE BYTEA USING convert_to(key, 'UTF8'),
    ALTER COLUMN message_uuid TYPE BYTEA USING convert_to(message_uuid, 'UTF8');

-- A key "uuid:<UUID>" whose one message has that UUID was a message
-- without a key.
UPDATE millwright_parked_keys k SET key = CASE
    WHEN substr(k.key, 1, 5) = convert_to('uuid:', 'UTF8')
        AND (SELECT count(*) FROM millwright_parked_messages m WHERE m.handler = k.handler AND m.key = k.key) = 1
        AND EXISTS (SELECT 1 FROM millwright_parked_messages m WHERE m.handler = k.handler AND m.key = k.key
            AND m.message_uuid = substr(k.key, 6))
    THEN '\x75'::bytea || substr(k.key, 6)
    ELSE '\x6b'::bytea || k.key END;

UPDATE millwright_parked_messages m SET key = CASE
    WHEN m.key = convert_to('uuid:', 'UTF8') || m.message_uuid
        AND EXISTS (SELECT 1 FROM millwright_parked_keys k WHERE k.handler = m.handler AND k.key = '\x75'::bytea || m.message_uuid)
    THEN '\x75'::bytea || m.message_uuid
    ELSE '\x6b'::bytea || m.key END;

ALTER TABLE millwright_parked_keys ADD PRIMARY KEY (handler, key);

ALTER TABLE millwright_parked_messages ADD COLUMN metadata_bytes BYTEA NOT NULL DEFAULT ''::bytea,
    ADD COLUMN dead_letter_id BIGINT;

UPDATE millwright_parked_messages m SET metadata_bytes = COALESCE((
    SELECT string_agg(int4send(octet_length(convert_to(e.key, 'UTF8'))) || convert_to(e.key, 'UTF8')
        || int4send(octet_length(convert_to(e.value, 'UTF8'))) || convert_to(e.value, 'UTF8'), ''::bytea ORDER BY e.key)
    FROM jsonb_each_text(m.metadata) e), ''::bytea);

-- A held key's dead letter belongs to its head.
UPDATE millwright_parked_messages m SET dead_letter_id = k.dead_letter_id
FROM millwright_parked_keys k
WHERE k.handler = m.handler AND k.key = m.key AND k.dead_letter_id IS NOT NULL
    AND m.id = (SELECT min(id) FROM millwright_parked_messages h WHERE h.handler = m.handler AND h.key = m.key);

ALTER TABLE millwright_parked_messages DROP COLUMN metadata;
ALTER TABLE millwright_parked_messages RENAME COLUMN metadata_bytes TO metadata;

ALTER TABLE millwright_parked_messages ADD CONSTRAINT millwright_parked_messages_handler_key_fkey
    FOREIGN KEY (handler, key) REFERENCES millwright_parked_keys (handler, key) ON DELETE CASCADE;

-- A replay finds the parked message of its dead letter.
CREATE INDEX millwright_parked_messages_dead_letter_idx ON millwright_parked_messages (handler, dead_letter_id)
    WHERE dead_letter_id IS NOT NULL;

-- The claim number of the retrier's round running the key's head now (NULL
-- when none): set by the claim, cleared when the round ends (rescheduled,
-- applied, dead-lettered, held, released). A replay of the head's dead
-- letter waits (it is nacked) while such a round's lease holds, instead of
-- replacing a message the round may apply in its old form.
ALTER TABLE millwright_parked_keys ADD COLUMN running_claim BIGINT;
