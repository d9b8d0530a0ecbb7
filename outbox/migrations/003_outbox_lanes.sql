-- Lanes: relays divide the outbox's aggregates between them instead of
-- racing for the heads of aggregates (see outbox/DESIGN.md).
--
-- Every row belongs to one of 64 lanes, a hash of its aggregate (of its id
-- for an event without one), so all events of an aggregate share a lane.
-- A relay publishes the lanes it holds (session advisory locks), in id
-- order, and nothing else; no other relay touches them meanwhile, so a
-- claim needs no row lease and no test for "is this the oldest pending
-- row of its aggregate".
--
-- The expression is repeated in outbox/relay_claim.go (laneExpr); the two
-- must stay identical, or the claim stops using this index
-- (TestClaim_UsesTheLaneIndex).
CREATE INDEX millwright_outbox_pending_lane_idx ON millwright_outbox
    ((CASE WHEN aggregate_id = '' THEN (id & 63)::int ELSE hashtext(aggregate_type || '/' || aggregate_id) & 63 END), id)
    WHERE status = 'pending';

-- Aggregates held back by a failing event: its row backs off with
-- retry_count > 0, and no later row of its aggregate may go out before it.
-- Inserted rows have retry_count 0, so writers never touch this index.
CREATE INDEX millwright_outbox_backoff_idx ON millwright_outbox (aggregate_type, aggregate_id, id)
    WHERE status = 'pending' AND retry_count > 0;

-- The head test of the claim is gone: this index only cost writers.
DROP INDEX millwright_outbox_pending_aggregate_idx;

-- Who holds which lane. A relay renews its lanes' leases while it runs
-- (well within RelayConfig.Lease); a lane whose lease ran out is free, so a
-- relay that dies delays its lanes by at most Lease. Relays divide the
-- lanes round-robin by their rank among the live ones
-- (millwright_outbox_relays): relay k of n holds the lanes l with
-- l % n = k. Plain tables and statements, no session state: any pool or
-- pooler works.
CREATE TABLE millwright_outbox_lanes (
    lane        INT         PRIMARY KEY CHECK (lane >= 0 AND lane < 64),
    owner       TEXT,
    lease_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity'
);
INSERT INTO millwright_outbox_lanes (lane) SELECT generate_series(0, 63);

CREATE TABLE millwright_outbox_relays (
    id         TEXT        PRIMARY KEY,
    seen_until TIMESTAMPTZ NOT NULL
);
