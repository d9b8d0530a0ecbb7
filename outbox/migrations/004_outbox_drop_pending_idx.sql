-- Writers keep two index inserts per event instead of three: the lane
-- index (003) holds every pending row, so the plain pending index only
-- cost writers. The claim reads the lane index; the backlog figures read
-- it too (outbox.ReadStats finds the oldest pending row as the oldest of
-- each lane's heads: 64 index probes however long the backlog).
DROP INDEX millwright_outbox_pending_idx;
