-- Message UUIDs and metadata as bytes (issue 40). A Kafka key or header is
-- bytes, and so is a Watermill UUID; stored as text (message_uuid) and
-- JSON (metadata), their invalid UTF-8 and NUL bytes were replaced with
-- U+FFFD, so a replay published another UUID and other headers (a binary
-- partition key too) than the message that failed.
--
-- message_uuid_raw is the message's UUID, byte for byte; metadata_raw its
-- metadata (without the dlq_* keys), byte for byte, in park's form
-- (storage.EncodeParkedMetadata, park migration 002): for each entry, by
-- key, its key's length (4 bytes, big endian), the key, its value's
-- length, the value. A replay (dlq.Store.Replay, `millwright dlq replay`,
-- the console) publishes these. message_uuid and metadata stay as the
-- text searches and the console's groups read (invalid bytes shown as
-- U+FFFD there).
--
-- Existing rows get the bytes of their text: what they kept (a metadata
-- written by hand that is not a JSON object stays NULL). Both columns
-- stay nullable: an instance of an older millwright still recording after
-- this migration writes NULL, and readers then take the text columns
-- (what that version stored), so nothing is refused during a rollout.
ALTER TABLE millwright_dead_letters
    ADD COLUMN message_uuid_raw BYTEA,
    ADD COLUMN metadata_raw BYTEA;

UPDATE millwright_dead_letters d SET message_uuid_raw = convert_to(d.message_uuid, 'UTF8'),
    metadata_raw = CASE WHEN jsonb_typeof(d.metadata) = 'object' THEN COALESCE((
        SELECT string_agg(int4send(octet_length(convert_to(e.key, 'UTF8'))) || convert_to(e.key, 'UTF8')
            || int4send(octet_length(convert_to(e.value, 'UTF8'))) || convert_to(e.value, 'UTF8'), ''::bytea ORDER BY e.key)
        FROM jsonb_each_text(d.metadata) e), ''::bytea) END;
