-- Retriable steps (saga.Step.Retriable): a step's failed or unanswered
-- command is sent again after its backoff instead of compensating. The
-- attempts of that round are counted in the round columns the compensations
-- use (compensation_attempts, compensation_started_at,
-- compensation_attempt_base); forward_retry says whose round it is.

ALTER TABLE millwright_saga_instances
    -- true while the current step is a Retriable step's command (running,
    -- waiting out its backoff, or stuck once its retries are spent): the
    -- round columns count its forward attempts, and `millwright saga
    -- resolve` on the stuck saga sends the command again (retry) or goes on
    -- with the next step (skip). false otherwise.
    ADD COLUMN forward_retry BOOLEAN NOT NULL DEFAULT false;
-- Waiting and timer steps (saga.Step.WaitFor, Sleep, Until) need no column:
-- they are a running instance at that step with its deadline_at, recorded in
-- millwright_saga_steps as kind wait or timer.
