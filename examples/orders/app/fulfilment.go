package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/saga"
)

// SagaName is the saga type of the order workflow.
const SagaName = "order_fulfilment"

// Reply types of the saga's steps (saga.Step defaults: step name +
// ".succeeded", ".failed", ".compensated").
const (
	ReplyReserved          = "reserve.succeeded"
	ReplyReserveFailed     = "reserve.failed"
	ReplyReleased          = "reserve.compensated"
	ReplyCharged           = "charge.succeeded"
	ReplyChargeFailed      = "charge.failed"
	ReplyRefunded          = "charge.compensated"
	ReplyScheduled         = "ship.succeeded"
	ReplyScheduleFailed    = "ship.failed"
	ReplyShipmentCancelled = "ship.compensated"
)

// Fulfilment is the saga's data: what the steps need to know of the order.
type Fulfilment struct {
	OrderID      string `json:"order_id"`
	SKU          string `json:"sku"`
	Qty          int    `json:"qty"`
	AmountCents  int64  `json:"amount_cents"`
	FailPayment  bool   `json:"fail_payment,omitempty"`
	FailShipping bool   `json:"fail_shipping,omitempty"`
}

// definitions are the two versions of the order workflow. Version 1:
// reserve stock, charge the payment, schedule the shipment, one after the
// other. Version 2: reserve and charge at once (neither needs the other),
// then schedule the shipment. In both a failure undoes the steps that took
// effect, last first (in version 2, whichever of reserve and charge
// succeeded, once the other has answered or timed out), a timeout the
// timed-out step too, and a step's success after its timeout is undone by
// its compensation. The versions keep their step names: replies and the
// participants are the same.
func (a *App) definitions() (v1, v2 *saga.Definition[Fulfilment], err error) {
	t := a.topics
	stock := func(typ string) func(Fulfilment) (saga.Command, error) {
		return func(d Fulfilment) (saga.Command, error) {
			return saga.Command{Topic: t.InventoryCommands, Type: typ, Payload: StockCommand{OrderID: d.OrderID, SKU: d.SKU, Qty: d.Qty}}, nil
		}
	}
	payment := func(typ string) func(Fulfilment) (saga.Command, error) {
		return func(d Fulfilment) (saga.Command, error) {
			return saga.Command{Topic: t.BillingCommands, Type: typ, Payload: PaymentCommand{OrderID: d.OrderID, AmountCents: d.AmountCents, Decline: d.FailPayment}}, nil
		}
	}
	shipment := func(typ string) func(Fulfilment) (saga.Command, error) {
		return func(d Fulfilment) (saga.Command, error) {
			return saga.Command{Topic: t.ShippingCommands, Type: typ, Payload: ShipmentCommand{OrderID: d.OrderID, Refuse: d.FailShipping}}, nil
		}
	}
	reserve := saga.Step[Fulfilment]{Name: "reserve", Command: stock(CommandReserve), Compensation: stock(CommandRelease), Timeout: a.cfg.StepTimeout}
	charge := saga.Step[Fulfilment]{Name: "charge", Command: payment(CommandCharge), Compensation: payment(CommandRefund), Timeout: a.cfg.StepTimeout}
	ship := saga.Step[Fulfilment]{Name: "ship", Command: shipment(CommandSchedule), Compensation: shipment(CommandCancel), Timeout: a.cfg.StepTimeout}
	if v1, err = saga.DefineVersion(SagaName, 1, reserve, charge, ship); err != nil {
		return nil, nil, err
	}
	v2, err = saga.DefineVersion(SagaName, 2, saga.Step[Fulfilment]{Name: "prepare", Parallel: []saga.Step[Fulfilment]{reserve, charge}}, ship)
	return v1, v2, err
}

// Mermaid returns the order workflow as a Mermaid state diagram.
func (a *App) Mermaid() string { return a.orch.Definition().Mermaid() }

// startSaga consumes the order events: each order.created.v1 starts one
// saga, in the idempotency transaction.
func (a *App) startSaga(msg *message.Message) error {
	ctx := msg.Context()
	tx, err := txFromContext(ctx)
	if err != nil {
		return failure.Permanent(fmt.Errorf("orchestrator: %w", err))
	}
	if msg.Metadata.Get(metadata.EventType) != EventOrderCreated {
		return nil // the orchestrator's own order.completed/cancelled events
	}
	var o Order
	if err := dlq.DecodeJSON(msg, &o); err != nil {
		return err
	}
	if o.ID == "" {
		return dlq.Malformed(fmt.Errorf("orchestrator: %s %s has no order id", EventOrderCreated, msg.UUID))
	}
	err = a.orch.Start(ctx, tx.handle(), o.ID, Fulfilment{OrderID: o.ID, SKU: o.SKU, Qty: o.Qty, AmountCents: o.AmountCents,
		FailPayment: o.FailPayment, FailShipping: o.FailShipping})
	if errors.Is(err, saga.ErrAlreadyStarted) {
		return nil
	}
	if err != nil {
		return err
	}
	return effect(ctx, tx, "orchestrator", o.ID, "start")
}

// settlement is the payload of order.completed.v1 and order.cancelled.v1.
type settlement struct {
	ID     string `json:"id"`
	Status string `json:"status"`
	Reason string `json:"reason,omitempty"`
}

// handleReply applies a participant's reply to its saga and, when that
// ends the saga, settles the order and announces it, all in the reply's
// idempotency transaction.
func (a *App) handleReply(msg *message.Message) error {
	if err := a.orch.HandleReply(msg); err != nil {
		return err
	}
	ctx := msg.Context()
	tx, err := txFromContext(ctx)
	if err != nil {
		return failure.Permanent(fmt.Errorf("orchestrator: %w", err))
	}
	return a.settle(ctx, tx, msg.Metadata.Get(metadata.SagaID))
}

// settle moves a pending order to completed or cancelled once its saga has
// ended, and writes order.completed.v1 or order.cancelled.v1.
func (a *App) settle(ctx context.Context, tx tx, orderID string) error {
	var (
		state  saga.State
		reason string
	)
	err := tx.queryRow(ctx, `SELECT state, COALESCE(last_error, '') FROM millwright_saga_instances WHERE id = $1`, orderID).Scan(&state, &reason)
	if err != nil {
		return fmt.Errorf("orchestrator: reading saga %s: %w", orderID, err)
	}
	s := settlement{ID: orderID, Reason: reason}
	evType := ""
	switch state {
	case saga.StateCompleted:
		s.Status, s.Reason, evType = StatusCompleted, "", EventOrderCompleted
	case saga.StateCompensated:
		s.Status, evType = StatusCancelled, EventOrderCancelled
	default:
		return nil
	}
	n, err := tx.exec(ctx, `UPDATE orders_orders SET status = $2, reason = $3, settled_at = now() WHERE id = $1 AND status = 'pending'`,
		orderID, s.Status, s.Reason)
	if err != nil {
		return fmt.Errorf("orchestrator: settling order %s: %w", orderID, err)
	}
	if n == 0 {
		return nil
	}
	payload, err := json.Marshal(s)
	if err != nil {
		return err
	}
	// The ledger row and the event: one round trip on pgx.
	return tx.emit(ctx, a.writer, outbox.Event{Topic: a.topics.OrderEvents, AggregateType: "order", AggregateID: orderID,
		EventType: evType, Payload: payload, Source: "examples/orders/orchestrator"},
		effectStatement("orchestrator", orderID, s.Status))
}

// notify consumes the order events as a second reader (its own consumer
// group): one notification per event.
func (a *App) notify(msg *message.Message) error {
	ctx := msg.Context()
	tx, err := txFromContext(ctx)
	if err != nil {
		return failure.Permanent(fmt.Errorf("notify: %w", err))
	}
	var ev struct {
		ID string `json:"id"`
	}
	if err := dlq.DecodeJSON(msg, &ev); err != nil {
		return err
	}
	typ := msg.Metadata.Get(metadata.EventType)
	if ev.ID == "" || typ == "" {
		return dlq.Malformed(fmt.Errorf("notify: order event %s has no id or no %s", msg.UUID, metadata.EventType))
	}
	if _, err := tx.exec(ctx, `INSERT INTO orders_notifications (order_id, event_type) VALUES ($1, $2)`, ev.ID, typ); err != nil {
		return fmt.Errorf("notify: %w", err)
	}
	return effect(ctx, tx, "notify", ev.ID, typ)
}
