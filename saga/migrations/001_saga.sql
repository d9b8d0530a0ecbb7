-- Saga instances: one row per running or finished saga. The orchestrator
-- changes a row only with UPDATE ... WHERE id = $1 AND version = $2, so of
-- two instances racing on one saga exactly one transition wins.
CREATE TABLE millwright_saga_instances (
    id                   TEXT        PRIMARY KEY,
    type                 TEXT        NOT NULL,
    -- running, compensating, completed, compensated or stuck.
    state                TEXT        NOT NULL,
    -- Index of the step whose command (running) or compensation
    -- (compensating, stuck) is current; -1 once no compensation is left.
    current_step         INT         NOT NULL DEFAULT 0,
    data                 JSONB       NOT NULL,
    version              BIGINT      NOT NULL DEFAULT 1,
    -- When the orchestrator's timeout loop must act: a step's reply is
    -- overdue, or a compensation is due to be (re)sent. NULL when nothing is
    -- scheduled (finished or stuck sagas).
    deadline_at          TIMESTAMPTZ,
    -- awaiting_reply tells the loop what a passed deadline means: true, a
    -- command is out and its reply is overdue; false, the next compensation
    -- command is due to be sent (backoff elapsed, or an operator resolved).
    awaiting_reply       BOOLEAN     NOT NULL DEFAULT true,
    -- Attempts of the current compensation command (0 before the first),
    -- and when the first of them was sent (retry.Policy.MaxElapsedTime).
    compensation_attempts INT        NOT NULL DEFAULT 0,
    compensation_started_at TIMESTAMPTZ,
    last_error           TEXT,
    created_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT millwright_saga_instances_state_check
        CHECK (state IN ('running', 'compensating', 'completed', 'compensated', 'stuck'))
);

-- The timeout loop claims due deadlines of its saga type with
-- FOR UPDATE SKIP LOCKED; finished sagas have no deadline and stay out of
-- the index.
CREATE INDEX millwright_saga_instances_due_idx
    ON millwright_saga_instances (type, deadline_at)
    WHERE deadline_at IS NOT NULL;

-- `millwright saga list --type --state`.
CREATE INDEX millwright_saga_instances_type_state_idx
    ON millwright_saga_instances (type, state, created_at);

-- Step history: every command sent, reply received, timeout and ignored
-- (late or duplicate) reply, in order. Written in the same transaction as
-- the transition it records.
CREATE TABLE millwright_saga_steps (
    id          BIGSERIAL   PRIMARY KEY,
    saga_id     TEXT        NOT NULL REFERENCES millwright_saga_instances (id) ON DELETE CASCADE,
    step        TEXT        NOT NULL,
    -- command, compensation, reply, compensation_reply, timeout, late_reply,
    -- duplicate, stuck, resolved, completed, compensated.
    kind        TEXT        NOT NULL,
    -- Reply type for replies; command type for commands.
    detail      TEXT        NOT NULL DEFAULT '',
    attempt     INT         NOT NULL DEFAULT 0,
    error       TEXT,
    at          TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX millwright_saga_steps_saga_idx ON millwright_saga_steps (saga_id, id);
