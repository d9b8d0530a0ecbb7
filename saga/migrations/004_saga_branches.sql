-- Parallel branches (saga.Step.Parallel): the state of each branch of the
-- groups a saga entered, a JSON object keyed by branch name, e.g.
-- {"reserve": {"state": "succeeded"}, "charge": {"state": "running",
-- "deadline": "2026-12-06T10:00:00Z"}}. NULL for a saga that entered no
-- group. While a group runs, deadline_at is the earliest deadline of its
-- running branches; the entries stay after the group completes, so that a
-- later failure compensates exactly the branches that succeeded or timed
-- out.

ALTER TABLE millwright_saga_instances ADD COLUMN branches JSONB;
