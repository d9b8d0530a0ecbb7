package app

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/saga"
)

// Command types the saga sends.
const (
	CommandReserve  = "inventory.reserve.v1"
	CommandRelease  = "inventory.release.v1"
	CommandCharge   = "billing.charge.v1"
	CommandRefund   = "billing.refund.v1"
	CommandSchedule = "shipping.schedule.v1"
	CommandCancel   = "shipping.cancel.v1"
)

// StockCommand is the payload of CommandReserve and CommandRelease.
type StockCommand struct {
	OrderID string `json:"order_id"`
	SKU     string `json:"sku"`
	Qty     int    `json:"qty"`
}

// PaymentCommand is the payload of CommandCharge and CommandRefund.
type PaymentCommand struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	// Decline makes the charge fail (the order's fail_payment flag).
	Decline bool `json:"decline,omitempty"`
}

// ShipmentCommand is the payload of CommandSchedule and CommandCancel.
type ShipmentCommand struct {
	OrderID string `json:"order_id"`
	// Refuse makes the shipment fail (the order's fail_shipping flag).
	Refuse bool `json:"refuse,omitempty"`
}

// outcome is a participant's answer: the reply type and, for failures, why;
// and the effect it applied, if any ("" for none), for the ledger.
type outcome struct {
	replyType string
	reason    string
	effect    string
}

// command is a participant's command: it names its order.
type command interface{ order() string }

func (c StockCommand) order() string    { return c.OrderID }
func (c PaymentCommand) order() string  { return c.OrderID }
func (c ShipmentCommand) order() string { return c.OrderID }

// participant adapts a service's command handling to a router handler: it
// takes the idempotency middleware's transaction, decodes the command, runs
// forward or compensate in that transaction, and writes the reply through
// the outbox in the same transaction, so the effect, the reply and the
// processed mark commit together or not at all.
func participant[C command](w *outbox.Writer, service string, valid func(C) error,
	forward, compensate func(ctx context.Context, tx tx, c C) (outcome, error),
) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, err := txFromContext(ctx)
		if err != nil {
			return failure.Permanent(fmt.Errorf("%s: %w", service, err))
		}
		if !saga.IsCommand(msg) {
			return dlq.Malformed(fmt.Errorf("%s: message %s is not a saga command (no %s metadata)", service, msg.UUID, metadata.SagaID))
		}
		var c C
		if err := dlq.DecodeJSON(msg, &c); err != nil {
			return err
		}
		if err := valid(c); err != nil {
			return dlq.Malformed(fmt.Errorf("%s: command %s: %w", service, msg.UUID, err))
		}
		var out outcome
		switch phase := msg.Metadata.Get(metadata.SagaPhase); phase {
		case saga.PhaseForward:
			out, err = forward(ctx, tx, c)
		case saga.PhaseCompensation:
			if compensate == nil {
				return dlq.Malformed(fmt.Errorf("%s: command %s asks for a compensation, which %s does not have", service, msg.UUID, service))
			}
			out, err = compensate(ctx, tx, c)
		default:
			return dlq.Malformed(fmt.Errorf("%s: command %s has %s %q: want forward or compensation", service, msg.UUID, metadata.SagaPhase, phase))
		}
		if err != nil {
			return fmt.Errorf("%s: %w", service, err)
		}
		ev, err := saga.ReplyEvent(msg, out.replyType, c)
		if err != nil {
			return dlq.Malformed(err)
		}
		ev.Source = "examples/orders/" + service
		if out.reason != "" {
			ev.Metadata[metadata.SagaError] = out.reason
		}
		// The ledger row of the effect and the reply: one round trip on pgx.
		var ledger []statement
		if out.effect != "" {
			ledger = append(ledger, effectStatement(service, c.order(), out.effect))
		}
		return tx.emit(ctx, w, ev, ledger...)
	}
}

const insertEffect = `INSERT INTO orders_effects (service, order_id, action) VALUES ($1, $2, $3)`

// effect records one applied effect in the ledger the summary counts.
func effect(ctx context.Context, tx tx, service, orderID, action string) error {
	_, err := tx.exec(ctx, insertEffect, service, orderID, action)
	return err
}

// effectStatement is effect, to be sent beside an event (tx.emit).
func effectStatement(service, orderID, action string) statement {
	return statement{sql: insertEffect, args: []any{service, orderID, action}}
}

func validStock(c StockCommand) error {
	if c.OrderID == "" || c.SKU == "" || c.Qty <= 0 {
		return fmt.Errorf("stock command %+v: want order_id, sku and a positive qty", c)
	}
	return nil
}

// reserve takes qty from the stock, once per order. A reservation already
// made answers success again; a tombstone (released before it was made)
// refuses.
func reserve(ctx context.Context, tx tx, c StockCommand) (outcome, error) {
	var status string
	err := tx.queryRow(ctx, `SELECT status FROM orders_reservations WHERE order_id = $1 FOR UPDATE`, c.OrderID).Scan(&status)
	switch {
	case err == nil && status == "reserved":
		return outcome{replyType: ReplyReserved}, nil
	case err == nil:
		return outcome{replyType: ReplyReserveFailed, reason: "order already cancelled"}, nil
	case !errors.Is(err, sql.ErrNoRows):
		return outcome{}, fmt.Errorf("reading reservation of %s: %w", c.OrderID, err)
	}
	n, err := tx.exec(ctx, `UPDATE orders_stock SET available = available - $2 WHERE sku = $1 AND available >= $2`, c.SKU, c.Qty)
	if err != nil {
		return outcome{}, fmt.Errorf("reserving %d x %s: %w", c.Qty, c.SKU, err)
	}
	if n == 0 {
		return outcome{replyType: ReplyReserveFailed, reason: fmt.Sprintf("out of stock: %d x %s", c.Qty, c.SKU)}, nil
	}
	if _, err := tx.exec(ctx, `INSERT INTO orders_reservations (order_id, sku, qty, status) VALUES ($1, $2, $3, 'reserved')`,
		c.OrderID, c.SKU, c.Qty); err != nil {
		return outcome{}, fmt.Errorf("recording reservation of %s: %w", c.OrderID, err)
	}
	return outcome{replyType: ReplyReserved, effect: "reserve"}, nil
}

// release gives a reservation's stock back, once. With no reservation it
// leaves a tombstone, so a reserve that arrives late is refused.
func release(ctx context.Context, tx tx, c StockCommand) (outcome, error) {
	n, err := tx.exec(ctx, `INSERT INTO orders_reservations (order_id, sku, qty, status) VALUES ($1, $2, 0, 'released') ON CONFLICT (order_id) DO NOTHING`,
		c.OrderID, c.SKU)
	if err != nil {
		return outcome{}, fmt.Errorf("releasing %s: %w", c.OrderID, err)
	}
	if n == 1 {
		return outcome{replyType: ReplyReleased}, nil // nothing was reserved
	}
	var (
		sku string
		qty int
	)
	err = tx.queryRow(ctx, `UPDATE orders_reservations SET status = 'released', updated_at = now()
		WHERE order_id = $1 AND status = 'reserved' RETURNING sku, qty`, c.OrderID).Scan(&sku, &qty)
	if errors.Is(err, sql.ErrNoRows) {
		return outcome{replyType: ReplyReleased}, nil // released before
	}
	if err != nil {
		return outcome{}, fmt.Errorf("releasing %s: %w", c.OrderID, err)
	}
	if _, err := tx.exec(ctx, `UPDATE orders_stock SET available = available + $2 WHERE sku = $1`, sku, qty); err != nil {
		return outcome{}, fmt.Errorf("returning %d x %s to stock: %w", qty, sku, err)
	}
	return outcome{replyType: ReplyReleased, effect: "release"}, nil
}

func validPayment(c PaymentCommand) error {
	if c.OrderID == "" || c.AmountCents < 0 {
		return fmt.Errorf("payment command %+v: want order_id and a non-negative amount_cents", c)
	}
	return nil
}

// charge takes the payment once per order, or declines it (flagged orders,
// amounts over the limit).
func (a *App) charge(ctx context.Context, tx tx, c PaymentCommand) (outcome, error) {
	var status string
	err := tx.queryRow(ctx, `SELECT status FROM orders_payments WHERE order_id = $1 FOR UPDATE`, c.OrderID).Scan(&status)
	switch {
	case err == nil && status == "charged":
		return outcome{replyType: ReplyCharged}, nil
	case err == nil:
		return outcome{replyType: ReplyChargeFailed, reason: "payment " + status}, nil
	case !errors.Is(err, sql.ErrNoRows):
		return outcome{}, fmt.Errorf("reading payment of %s: %w", c.OrderID, err)
	}
	if c.Decline || c.AmountCents > a.cfg.PaymentLimitCents {
		if _, err := tx.exec(ctx, `INSERT INTO orders_payments (order_id, amount_cents, status) VALUES ($1, $2, 'declined')`,
			c.OrderID, c.AmountCents); err != nil {
			return outcome{}, fmt.Errorf("recording declined payment of %s: %w", c.OrderID, err)
		}
		return outcome{replyType: ReplyChargeFailed, reason: "payment declined", effect: "decline"}, nil
	}
	if _, err := tx.exec(ctx, `INSERT INTO orders_payments (order_id, amount_cents, status) VALUES ($1, $2, 'charged')`,
		c.OrderID, c.AmountCents); err != nil {
		return outcome{}, fmt.Errorf("charging %s: %w", c.OrderID, err)
	}
	return outcome{replyType: ReplyCharged, effect: "charge"}, nil
}

// refund gives a charged payment back, once; with no payment it leaves a
// tombstone, so a charge that arrives late is refused.
func refund(ctx context.Context, tx tx, c PaymentCommand) (outcome, error) {
	n, err := tx.exec(ctx, `INSERT INTO orders_payments (order_id, amount_cents, status) VALUES ($1, 0, 'refunded') ON CONFLICT (order_id) DO NOTHING`, c.OrderID)
	if err != nil {
		return outcome{}, fmt.Errorf("refunding %s: %w", c.OrderID, err)
	}
	if n == 1 {
		return outcome{replyType: ReplyRefunded}, nil
	}
	n, err = tx.exec(ctx, `UPDATE orders_payments SET status = 'refunded', updated_at = now() WHERE order_id = $1 AND status = 'charged'`, c.OrderID)
	if err != nil {
		return outcome{}, fmt.Errorf("refunding %s: %w", c.OrderID, err)
	}
	if n == 0 {
		return outcome{replyType: ReplyRefunded}, nil // declined or refunded before
	}
	return outcome{replyType: ReplyRefunded, effect: "refund"}, nil
}

func validShipment(c ShipmentCommand) error {
	if c.OrderID == "" {
		return errors.New("shipment command has no order_id")
	}
	return nil
}

// schedule books a shipment once per order, or refuses flagged orders.
func schedule(ctx context.Context, tx tx, c ShipmentCommand) (outcome, error) {
	var status string
	err := tx.queryRow(ctx, `SELECT status FROM orders_shipments WHERE order_id = $1`, c.OrderID).Scan(&status)
	switch {
	case err == nil && status == "scheduled":
		return outcome{replyType: ReplyScheduled}, nil
	case err == nil:
		return outcome{replyType: ReplyScheduleFailed, reason: "shipment " + status}, nil
	case !errors.Is(err, sql.ErrNoRows):
		return outcome{}, fmt.Errorf("reading shipment of %s: %w", c.OrderID, err)
	}
	status, out := "scheduled", outcome{replyType: ReplyScheduled, effect: "scheduled"}
	if c.Refuse {
		status, out = "refused", outcome{replyType: ReplyScheduleFailed, reason: "shipment refused: no carrier serves the address", effect: "refused"}
	}
	if _, err := tx.exec(ctx, `INSERT INTO orders_shipments (order_id, status) VALUES ($1, $2)`, c.OrderID, status); err != nil {
		return outcome{}, fmt.Errorf("scheduling shipment of %s: %w", c.OrderID, err)
	}
	return out, nil
}

// cancelShipment cancels a scheduled shipment, once. With none scheduled it
// does nothing and leaves no tombstone: should the schedule command still
// run after it (shipping was down past the step's timeout), its success
// reply is late, and the orchestrator sends this cancellation again (the
// saga's rule for every step with a compensation).
func cancelShipment(ctx context.Context, tx tx, c ShipmentCommand) (outcome, error) {
	n, err := tx.exec(ctx, `UPDATE orders_shipments SET status = 'cancelled', updated_at = now() WHERE order_id = $1 AND status = 'scheduled'`, c.OrderID)
	if err != nil {
		return outcome{}, fmt.Errorf("cancelling shipment of %s: %w", c.OrderID, err)
	}
	if n == 0 {
		return outcome{replyType: ReplyShipmentCancelled}, nil // nothing scheduled, or cancelled before
	}
	return outcome{replyType: ReplyShipmentCancelled, effect: "cancel"}, nil
}
