-- Change data capture: Debezium's outbox event router relays the outbox
-- instead of (or, while switching, beside) millwright's relay. See
-- deploy/debezium/README.md and "Relaying with Debezium" in
-- docs/operations.md.
--
-- The router takes the topic, key, payload and headers of a Kafka record
-- from columns of the inserted row, as they are, while millwright's relay
-- derives most of an event's metadata from the row when it reads it (see
-- derivedMetadata in outbox/event.go) and keeps the payload in one of two
-- columns. Three columns hold the record as the relay would publish it:
--
--   wire_key      the Kafka key (metadata.OrderingKey), NULL for none
--   wire_headers  every Kafka header, JSON object of strings: the derived
--                 CloudEvents attributes, the stored metadata over them,
--                 ce_datacontenttype as "content-type" (the Kafka binding),
--                 and Watermill's _watermill_message_uuid
--   wire_payload  the payload bytes: payload_raw, or the JSONB payload's
--                 text as the relay reads it
--
-- They are filled by a BEFORE INSERT row trigger that is NOT created here:
-- a system that does not use Debezium pays nothing but three NULL columns
-- (adding a nullable column without a default rewrites nothing). The
-- trigger, the publication and the replication slot are created when
-- capture is switched on (storage.EnableCapture; the SQL is in
-- deploy/debezium/README.md).
ALTER TABLE millwright_outbox
    ADD COLUMN wire_key     TEXT,
    ADD COLUMN wire_headers JSONB,
    ADD COLUMN wire_payload BYTEA;

-- The same computation as outbox.rowMessageCached plus the Kafka
-- transport's Marshaler. ce_time is created_at in UTC as Go's
-- time.RFC3339Nano writes it (trailing zeros of the fraction dropped).
CREATE FUNCTION millwright_outbox_capture() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    h   jsonb;
    key text;
    t   text;
BEGIN
    t := rtrim(rtrim(to_char(NEW.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'), '0'), '.') || 'Z';
    key := CASE WHEN NEW.aggregate_type = '' THEN NEW.aggregate_id ELSE NEW.aggregate_type || '/' || NEW.aggregate_id END;
    h := jsonb_build_object('ce_id', NEW.event_id, 'ce_specversion', '1.0', 'ce_time', t);
    IF NEW.aggregate_id <> '' THEN
        h := h || jsonb_build_object('ce_subject', NEW.aggregate_id, 'aggregate_id', NEW.aggregate_id, 'ordering_key', key);
    END IF;
    IF NEW.aggregate_type <> '' THEN
        h := h || jsonb_build_object('aggregate_type', NEW.aggregate_type);
    END IF;
    IF NEW.event_type <> '' THEN
        h := h || jsonb_build_object('ce_type', NEW.event_type);
    END IF;
    IF NEW.payload IS NOT NULL THEN
        h := h || jsonb_build_object('ce_datacontenttype', 'application/json');
    END IF;
    -- Stored metadata wins, but for the id (the column is authoritative)
    -- and an empty ordering key (it may replace the key, not remove it).
    h := h || NEW.metadata || jsonb_build_object('ce_id', NEW.event_id);
    IF NEW.aggregate_id <> '' AND coalesce(h->>'ordering_key', '') = '' THEN
        h := h || jsonb_build_object('ordering_key', key);
    END IF;
    IF h ? 'ce_datacontenttype' THEN
        h := (h - 'ce_datacontenttype') || jsonb_build_object('content-type', h->>'ce_datacontenttype');
    END IF;
    NEW.wire_headers := h || jsonb_build_object('_watermill_message_uuid', NEW.event_id);
    NEW.wire_key := nullif(h->>'ordering_key', '');
    NEW.wire_payload := coalesce(NEW.payload_raw, textsend(NEW.payload::text));
    RETURN NEW;
END;
$$;

-- Debezium does not mark rows published. A capture mark records, at one
-- moment, the WAL insert position and the snapshot: once the connector's
-- slot has confirmed a position at or past lsn, every row visible in snap
-- is on Kafka, and the cleaner's helper marks those rows published
-- (storage.MarkCaptured), so retention, `millwright outbox status` and the
-- way back to the relay work as before.
CREATE TABLE millwright_outbox_capture_marks (
    id       BIGSERIAL   PRIMARY KEY,
    lsn      PG_LSN      NOT NULL,
    snap     PG_SNAPSHOT NOT NULL,
    taken_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The 64-bit id of a row's 32-bit xmin, taken as the nearest to ref (a
-- row is never 2^31 transactions away from the snapshots it is compared
-- with: pending rows are young).
CREATE FUNCTION millwright_xid8(x xid, ref xid8) RETURNS xid8
LANGUAGE sql IMMUTABLE AS $$
    SELECT (ref::text::bigint
        + (((x::text::bigint - ref::text::bigint % 4294967296 + 2147483648) % 4294967296 + 4294967296) % 4294967296
        - 2147483648))::text::xid8
$$;
