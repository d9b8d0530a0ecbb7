-- One row per run of a state-changing operator command (dlq replay, outbox
-- retry-failed, saga resolve, idempotency clean), dry runs included.
CREATE TABLE millwright_audit (
    id          BIGSERIAL PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    os_user     TEXT NOT NULL,
    hostname    TEXT NOT NULL,
    command     TEXT NOT NULL,
    args        TEXT[] NOT NULL DEFAULT '{}',
    dry_run     BOOLEAN NOT NULL,
    confirmed   TEXT NOT NULL,
    affected    BIGINT NOT NULL,
    error       TEXT
);

CREATE INDEX millwright_audit_at_idx ON millwright_audit (at);
