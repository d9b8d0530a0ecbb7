-- Shipping gets a compensation: a scheduled shipment can be cancelled
-- (the saga gave up on the order, or shipping scheduled it after the
-- step's timeout and the orchestrator undoes that late success).
ALTER TABLE orders_shipments DROP CONSTRAINT orders_shipments_status_check;
ALTER TABLE orders_shipments ADD CONSTRAINT orders_shipments_status_check
    CHECK (status IN ('scheduled', 'refused', 'cancelled'));
ALTER TABLE orders_shipments ADD COLUMN updated_at TIMESTAMPTZ NOT NULL DEFAULT now();
