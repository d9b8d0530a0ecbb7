-- A wake-up channel that fits Postgres' 63-byte names for any schema.
--
-- 002's trigger notified 'millwright_outbox:' || schema. For a schema of
-- 46 bytes or more that is over 63 bytes: pg_notify refuses it (22023,
-- "channel name too long") while LISTEN silently truncates it, so a relay
-- started fine and then, whenever it was idle (holding the wake-up lock),
-- every writer's insert failed.
--
-- The channel is now the old name for a schema of at most 45 bytes (so
-- that relays and writers of the version before keep waking each other
-- during an upgrade), and 'millwright_outbox#' || md5(schema) (50 bytes)
-- for a longer one. The '#' keeps the two forms apart: no short schema's
-- name starts with it. outbox.NotifyChannel computes the same name in Go
-- (TestNotifyChannel_SQLAgrees); keep the two identical.
--
-- Upgrading with a schema of 46 bytes or more: from this migration on,
-- writers no longer fail. Relays of the version before listen on the
-- truncated name, so they poll (RelayConfig.PollInterval) until replaced,
-- and their own notifications still fail as before: deploy the relays of
-- this version. For shorter schemas nothing changes.
--
-- CREATE OR REPLACE keeps the function's oid, so the trigger of either
-- layout (plain or partitioned, whose trigger was recreated from 002's
-- definition) calls the new body; sessions pick it up at their next call.
CREATE OR REPLACE FUNCTION millwright_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1836543864, TG_RELID::int4) THEN
        -- Delivered at commit; a rolled-back transaction wakes nobody.
        PERFORM pg_notify(CASE WHEN octet_length(TG_TABLE_SCHEMA::text) <= 45
            THEN 'millwright_outbox:' || TG_TABLE_SCHEMA
            ELSE 'millwright_outbox#' || md5(TG_TABLE_SCHEMA::text) END, '');
    END IF;
    RETURN NULL;
END;
$$;
