-- Debezium capture judges a row by the transaction that INSERTED it.
--
-- Before this migration the capture marks (008) compared a row's xmin with
-- a mark's snapshot. xmin names the last transaction that wrote the row
-- version, not the one that inserted it: one failed publish (the relay's
-- retry_count UPDATE) or `outbox retry-failed` gave a row inserted before
-- the replication slot an xmin after it, so the row counted as "after the
-- slot" (the switch's drain saw 0 pending while it was pending) and the
-- tracker marked it published once Debezium confirmed a later mark,
-- though the connector never streams an UPDATE. A row inserted in a
-- savepoint also has its subtransaction's xmin, which no snapshot lists.
--
-- insert_xid is the inserting top-level transaction (pg_current_xact_id),
-- set by the capture trigger, so it costs nothing while capture is off.
-- NULL means the row was inserted while the trigger did not exist: before
-- outbox.EnableCapture returned, hence before any slot registered after it
-- (below); such a row is always "before the slot", the relay's to publish,
-- and never marked by the tracker. Adding a nullable column without a
-- default rewrites nothing.
ALTER TABLE millwright_outbox ADD COLUMN insert_xid XID8;

-- One row per replication slot a switch to Debezium registered
-- (outbox.SwitchToDebezium, `millwright outbox switch-to-debezium`): the
-- boundary is a snapshot and WAL position taken after the slot existed. A
-- row whose inserting transaction the boundary sees is the relay's (the
-- switch waits until none is pending); a row it does not see committed
-- after the slot's consistent point, so the slot streams it, and the
-- tracker marks it published once the slot confirms a mark that sees it.
-- A mark taken before the boundary (a tracker still running from an
-- earlier capture) sees only rows the boundary sees too: it marks nothing.
CREATE TABLE millwright_outbox_capture_slots (
    slot          TEXT        PRIMARY KEY,
    boundary_lsn  PG_LSN      NOT NULL,
    boundary_snap PG_SNAPSHOT NOT NULL,
    registered_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- 008's function, plus insert_xid.
CREATE OR REPLACE FUNCTION millwright_outbox_capture() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    h   jsonb;
    key text;
    t   text;
BEGIN
    NEW.insert_xid := pg_current_xact_id();
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
