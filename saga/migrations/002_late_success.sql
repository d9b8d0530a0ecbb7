-- A late success (a step's success reply after the step timed out) sends
-- that step's compensation, which may interrupt the compensation in
-- progress or reopen a compensated saga; and a compensation's failures no
-- longer hide why the saga is compensating.

ALTER TABLE millwright_saga_instances
    -- The wire attempt of the current compensation is
    -- compensation_attempt_base + compensation_attempts. A round of a
    -- step's compensation starts after the highest attempt that step was
    -- ever sent with, so a reply to an earlier attempt is never taken for
    -- the answer to a later one.
    ADD COLUMN compensation_attempt_base INT NOT NULL DEFAULT 0,
    -- Set while a late success's compensation runs: the step whose
    -- compensation the chain continues with afterwards (-1: none, the saga
    -- is compensated again). NULL otherwise.
    ADD COLUMN resume_step INT,
    -- Why the saga is compensating (the failure, timeout or command error
    -- that started it). last_error begins with it while compensations fail
    -- and is set back to it once the saga is compensated.
    ADD COLUMN cause TEXT;
-- A late success is recorded in millwright_saga_steps as kind late_success.
