-- Lending lanes (see outbox/DESIGN.md, "Lending lanes"). Lanes are divided
-- between relays by count, not by backlog, so with a finite backlog some
-- relays run out of work while others still have a lot. A relay now says,
-- at each lane check, how its last round went (load): 'spare' (its lanes
-- had nothing due), 'some' or 'full' (its batch came back full). A full
-- relay lends some of its lanes that still have rows to a spare one,
-- between rounds (nothing of them in flight); the borrower publishes them
-- in id order as their owner would, and gives each back, between rounds,
-- once it found nothing due in it. lent marks a lane held by a relay other
-- than the one whose share it is.
--
-- Stop the relays of the version before, then start the new ones (they
-- read and write both columns).
ALTER TABLE millwright_outbox_relays ADD COLUMN load TEXT NOT NULL DEFAULT 'some'
    CHECK (load IN ('spare', 'some', 'full'));
ALTER TABLE millwright_outbox_lanes ADD COLUMN lent BOOLEAN NOT NULL DEFAULT false;
