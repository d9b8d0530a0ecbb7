-- Tables of the order example. Each service owns its tables (orders_*
-- prefix plus the service name); the example keeps them in one database so
-- that one Postgres is all it needs, but no service reads another's tables
-- except the orchestrator, which belongs to the order service.

-- Order service.
CREATE TABLE orders_orders (
    id            TEXT        PRIMARY KEY,
    sku           TEXT        NOT NULL,
    qty           INT         NOT NULL CHECK (qty > 0),
    amount_cents  BIGINT      NOT NULL CHECK (amount_cents >= 0),
    fail_payment  BOOLEAN     NOT NULL DEFAULT false,
    fail_shipping BOOLEAN     NOT NULL DEFAULT false,
    -- pending until the saga ends, then completed or cancelled.
    status        TEXT        NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'completed', 'cancelled')),
    reason        TEXT        NOT NULL DEFAULT '',
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    settled_at    TIMESTAMPTZ
);
CREATE INDEX orders_orders_status_idx ON orders_orders (status);

-- Inventory service: stock per SKU, one reservation row per order.
-- A release that arrives before its reserve (the reserve timed out) leaves
-- a 'released' tombstone with qty 0, so the late reserve is refused.
CREATE TABLE orders_stock (
    sku       TEXT   PRIMARY KEY,
    initial   BIGINT NOT NULL,
    available BIGINT NOT NULL CHECK (available >= 0)
);
CREATE TABLE orders_reservations (
    order_id   TEXT        PRIMARY KEY,
    sku        TEXT        NOT NULL,
    qty        INT         NOT NULL,
    status     TEXT        NOT NULL CHECK (status IN ('reserved', 'released')),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Billing service: one payment row per order (tombstone as above).
CREATE TABLE orders_payments (
    order_id     TEXT        PRIMARY KEY,
    amount_cents BIGINT      NOT NULL,
    status       TEXT        NOT NULL CHECK (status IN ('charged', 'declined', 'refunded')),
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Shipping service.
CREATE TABLE orders_shipments (
    order_id     TEXT        PRIMARY KEY,
    status       TEXT        NOT NULL CHECK (status IN ('scheduled', 'refused')),
    scheduled_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Notification service: one row per notification sent.
CREATE TABLE orders_notifications (
    order_id   TEXT        NOT NULL,
    event_type TEXT        NOT NULL,
    sent_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX orders_notifications_order_idx ON orders_notifications (order_id);

-- Every effect any service applies, one row per application, with no
-- unique key on purpose: an effect applied twice shows up as two rows, and
-- the demo and the tests count them (duplicate_effects).
CREATE TABLE orders_effects (
    service  TEXT        NOT NULL,
    order_id TEXT        NOT NULL,
    action   TEXT        NOT NULL,
    at       TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX orders_effects_order_idx ON orders_effects (order_id);
