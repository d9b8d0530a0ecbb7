-- The partitioned layout of the outbox (opt-in: outbox.PartitionedMigrations(),
-- `millwright migrate --outbox-partitioned`; see docs/partitioning.md).
--
-- millwright_outbox becomes a table partitioned by day on created_at (UTC
-- days), so that retention drops whole partitions instead of deleting rows:
-- no bulk DELETE, no dead tuples, no vacuum debt. The outbox's own
-- migrations (outbox.Migrations()) run first and create the plain table;
-- this one converts it, rows included, in one transaction:
--
--   * the plain table is renamed away, and a partitioned table of the same
--     columns, defaults and CHECK constraints takes its name (relays and
--     writers find it by name; prepared statements are re-planned);
--   * the primary key becomes (id, created_at): Postgres wants the
--     partition key in every unique index. id stays unique in practice (the
--     same sequence, now owned by the new table, keeps numbering);
--   * every other index and trigger of the plain table is recreated on the
--     partitioned one from its own definition (pg_get_indexdef,
--     pg_get_triggerdef), so the relay's lane and backoff indexes, the
--     failed index and the wake-up trigger are all there, whatever later
--     outbox migrations added (TestPartitioned_SameIndexesAndTriggers);
--   * partitions: one for every row older than today (from MINVALUE), one per
--     day from today to two days ahead (the cleaner keeps
--     CleanerConfig.PartitionsAhead days ahead), and a DEFAULT partition so
--     that no write ever fails for want of a partition;
--   * every row moves, ids, status, retry counts and leases kept: a pending
--     row stays pending, a published one published, so no event is lost
--     and none is published again (TestPartitioned_MigrateWithPendingRows);
--     10000 rows per INSERT, each followed by a progress NOTICE.
--
-- The rename takes an ACCESS EXCLUSIVE lock until the commit: writers and
-- relays wait while the rows are copied (measured: 1.6 s for 200,000 rows
-- of 300-byte payloads, on 2 busy cores).
-- Run the outbox cleaner first so that only pending and recent rows are left.
-- Relays that were running keep publishing but fall back to polling
-- (RelayConfig.PollInterval) until restarted: the wake-up lock is keyed by
-- the table's oid, which changes.
--
-- Storage parameters (fillfactor) cannot be set on a partitioned table;
-- each partition gets fillfactor 70 like the plain table.
DO $migration$
DECLARE
    today timestamptz := date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    r     record;
    seq   text;
    d     int;
    total bigint;
    moved bigint := 0;
    n     bigint;
    last  bigint := -9223372036854775808; -- below every id
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = 'millwright_outbox'::regclass) = 'p' THEN
        RAISE EXCEPTION 'millwright_outbox is already partitioned';
    END IF;

    ALTER TABLE millwright_outbox RENAME TO millwright_outbox_unpartitioned;
    ALTER INDEX millwright_outbox_pkey RENAME TO millwright_outbox_unpartitioned_pkey;

    CREATE TABLE millwright_outbox (
        LIKE millwright_outbox_unpartitioned INCLUDING ALL EXCLUDING INDEXES,
        CONSTRAINT millwright_outbox_pkey PRIMARY KEY (id, created_at)
    ) PARTITION BY RANGE (created_at);

    seq := pg_get_serial_sequence('millwright_outbox_unpartitioned', 'id');
    IF seq IS NOT NULL THEN
        EXECUTE format('ALTER SEQUENCE %s OWNED BY millwright_outbox.id', seq);
    END IF;

    -- Indexes: every one but the primary key, by its own definition.
    FOR r IN
        SELECT i.indexrelid::regclass AS name, pg_get_indexdef(i.indexrelid) AS def
        FROM pg_index i
        WHERE i.indrelid = 'millwright_outbox_unpartitioned'::regclass AND NOT i.indisprimary
        ORDER BY i.indexrelid
    LOOP
        EXECUTE format('DROP INDEX %s', r.name);
        EXECUTE regexp_replace(r.def, ' ON (ONLY )?\S+ USING ', ' ON millwright_outbox USING ');
    END LOOP;

    -- Triggers (the wake-up trigger), likewise.
    FOR r IN
        SELECT t.tgname, pg_get_triggerdef(t.oid) AS def
        FROM pg_trigger t
        WHERE t.tgrelid = 'millwright_outbox_unpartitioned'::regclass AND NOT t.tgisinternal
        ORDER BY t.oid
    LOOP
        EXECUTE format('DROP TRIGGER %I ON millwright_outbox_unpartitioned', r.tgname);
        EXECUTE regexp_replace(r.def, ' ON \S+ (FOR|REFERENCING|FROM|NOT|DEFERRABLE|INITIALLY|WHEN|EXECUTE) ', ' ON millwright_outbox \1 ');
    END LOOP;

    EXECUTE format('CREATE TABLE %I PARTITION OF millwright_outbox FOR VALUES FROM (MINVALUE) TO (%L) WITH (fillfactor = 70)',
        'millwright_outbox_pbefore_' || to_char(today AT TIME ZONE 'UTC', 'YYYYMMDD'), today);
    FOR d IN 0..2 LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF millwright_outbox FOR VALUES FROM (%L) TO (%L) WITH (fillfactor = 70)',
            'millwright_outbox_p' || to_char((today + d * interval '1 day') AT TIME ZONE 'UTC', 'YYYYMMDD'),
            today + d * interval '1 day', today + (d + 1) * interval '1 day');
    END LOOP;
    CREATE TABLE millwright_outbox_default PARTITION OF millwright_outbox DEFAULT WITH (fillfactor = 70);

    -- The rows move 10000 at a time in id order (keyset, so sparse ids
    -- cost nothing), all in this one transaction; after each batch a
    -- NOTICE tells the client how far it is (`millwright migrate` prints
    -- it as progress; other clients ignore notices or log them).
    SELECT count(*) INTO total FROM millwright_outbox_unpartitioned;
    RAISE NOTICE 'millwright progress: outbox partitioned conversion: % of % rows moved', moved, total;
    LOOP
        WITH batch AS (
            INSERT INTO millwright_outbox
            SELECT * FROM millwright_outbox_unpartitioned
            WHERE id > last ORDER BY id LIMIT 10000
            RETURNING id
        )
        SELECT count(*), max(id) INTO n, last FROM batch;
        EXIT WHEN n = 0;
        moved := moved + n;
        RAISE NOTICE 'millwright progress: outbox partitioned conversion: % of % rows moved', moved, total;
    END LOOP;
    DROP TABLE millwright_outbox_unpartitioned;
END
$migration$;
