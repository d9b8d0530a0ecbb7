-- The payments service's own tables. The effect tables have no unique key
-- on purpose: a doubled effect shows as a second row (the test counts
-- them) instead of failing on a constraint.
CREATE TABLE payments (
    id         TEXT PRIMARY KEY,
    account    TEXT NOT NULL,
    amount     BIGINT NOT NULL,
    state      TEXT NOT NULL DEFAULT 'submitted', -- submitted, settled, failed
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE payments_holds (payment_id TEXT NOT NULL, account TEXT NOT NULL, amount BIGINT NOT NULL, released BOOLEAN NOT NULL DEFAULT false);
CREATE TABLE payments_charges (payment_id TEXT NOT NULL, amount BIGINT NOT NULL, refunded BOOLEAN NOT NULL DEFAULT false);
CREATE TABLE payments_notifications (payment_id TEXT NOT NULL, sent_at TIMESTAMPTZ NOT NULL DEFAULT now());
