package app

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/outbox"
)

// Event types of the order service, on Topics.OrderEvents.
const (
	EventOrderCreated   = "order.created.v1"
	EventOrderCompleted = "order.completed.v1"
	EventOrderCancelled = "order.cancelled.v1"
)

// Order statuses.
const (
	StatusPending   = "pending"
	StatusCompleted = "completed"
	StatusCancelled = "cancelled"
)

// Order is an order as the order service stores and publishes it.
type Order struct {
	ID          string `json:"id"`
	SKU         string `json:"sku"`
	Qty         int    `json:"qty"`
	AmountCents int64  `json:"amount_cents"`
	// FailPayment makes billing decline the charge (demo and tests).
	FailPayment bool `json:"fail_payment,omitempty"`
	// FailShipping makes shipping refuse the shipment, so that the saga
	// refunds the payment and releases the stock.
	FailShipping bool       `json:"fail_shipping,omitempty"`
	Status       string     `json:"status"`
	Reason       string     `json:"reason,omitempty"`
	CreatedAt    time.Time  `json:"created_at"`
	SettledAt    *time.Time `json:"settled_at,omitempty"`
}

// ErrOrderNotFound is returned (wrapped) by GetOrder for an unknown id.
var ErrOrderNotFound = errors.New("order not found")

// ErrInvalidOrder is returned (wrapped) by PlaceOrder for a request that
// cannot become an order.
var ErrInvalidOrder = errors.New("invalid order")

// PlaceOrder stores a new order and its order.created.v1 event in one
// transaction: the event is published if and only if the order exists. An
// empty o.ID gets a UUID. Placing an id that exists returns the existing
// order unchanged (a retried POST is harmless).
func (a *App) PlaceOrder(ctx context.Context, o Order) (Order, error) {
	if o.ID == "" {
		o.ID = watermill.NewUUID()
	}
	switch {
	case o.SKU == "":
		return Order{}, fmt.Errorf("%w: sku is empty", ErrInvalidOrder)
	case o.Qty <= 0:
		return Order{}, fmt.Errorf("%w: qty %d: want at least 1", ErrInvalidOrder, o.Qty)
	case o.AmountCents < 0:
		return Order{}, fmt.Errorf("%w: amount_cents %d is negative", ErrInvalidOrder, o.AmountCents)
	}
	o.Status, o.Reason, o.SettledAt = StatusPending, "", nil
	tx, err := a.db.begin(ctx)
	if err != nil {
		return Order{}, fmt.Errorf("placing order %s: begin: %w", o.ID, err)
	}
	defer func() { _ = tx.rollback(ctx) }()
	err = tx.queryRow(ctx, `INSERT INTO orders_orders (id, sku, qty, amount_cents, fail_payment, fail_shipping)
		VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO NOTHING RETURNING created_at`,
		o.ID, o.SKU, o.Qty, o.AmountCents, o.FailPayment, o.FailShipping).Scan(&o.CreatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return a.GetOrder(ctx, o.ID)
	}
	if err != nil {
		return Order{}, fmt.Errorf("placing order %s: %w", o.ID, err)
	}
	payload, err := json.Marshal(o)
	if err != nil {
		return Order{}, fmt.Errorf("placing order %s: %w", o.ID, err)
	}
	// The event is written in the business transaction, checked against
	// the transport's limits (App.writer).
	if err := tx.emit(ctx, a.writer, outbox.Event{
		Topic: a.topics.OrderEvents, AggregateType: "order", AggregateID: o.ID,
		EventType: EventOrderCreated, Payload: payload, Source: "examples/orders/orders",
	}); err != nil {
		return Order{}, fmt.Errorf("placing order %s: %w", o.ID, err)
	}
	if err := tx.commit(ctx); err != nil {
		return Order{}, fmt.Errorf("placing order %s: commit: %w", o.ID, err)
	}
	return o, nil
}

// GetOrder returns the order with its current status.
func (a *App) GetOrder(ctx context.Context, id string) (Order, error) {
	var (
		o       Order
		settled sql.NullTime
	)
	err := a.db.queryRow(ctx, `SELECT id, sku, qty, amount_cents, fail_payment, fail_shipping, status, reason, created_at, settled_at
		FROM orders_orders WHERE id = $1`, id).
		Scan(&o.ID, &o.SKU, &o.Qty, &o.AmountCents, &o.FailPayment, &o.FailShipping, &o.Status, &o.Reason, &o.CreatedAt, &settled)
	if errors.Is(err, sql.ErrNoRows) {
		return Order{}, fmt.Errorf("%w: %q", ErrOrderNotFound, id)
	}
	if err != nil {
		return Order{}, fmt.Errorf("reading order %s: %w", id, err)
	}
	if settled.Valid {
		o.SettledAt = &settled.Time
	}
	return o, nil
}

// Handler returns the order service's HTTP API and /metrics:
//
//	POST /orders        {"sku":"book","qty":1,"amount_cents":1500,"fail_payment":false}
//	GET  /orders/{id}
//	GET  /metrics       every millwright metric (Prometheus text format)
func (a *App) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		var o Order
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&o); err != nil {
			httpError(w, http.StatusBadRequest, fmt.Errorf("decoding order JSON: %w", err))
			return
		}
		o, err := a.PlaceOrder(r.Context(), o)
		switch {
		case errors.Is(err, ErrInvalidOrder):
			httpError(w, http.StatusBadRequest, err)
		case err != nil:
			httpError(w, http.StatusInternalServerError, err)
		default:
			w.Header().Set("Location", "/orders/"+o.ID)
			writeJSON(w, http.StatusCreated, o)
		}
	})
	mux.HandleFunc("GET /orders/{id}", func(w http.ResponseWriter, r *http.Request) {
		o, err := a.GetOrder(r.Context(), r.PathValue("id"))
		switch {
		case errors.Is(err, ErrOrderNotFound):
			httpError(w, http.StatusNotFound, err)
		case err != nil:
			httpError(w, http.StatusInternalServerError, err)
		default:
			writeJSON(w, http.StatusOK, o)
		}
	})
	mux.Handle("GET /metrics", a.MetricsHandler())
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func httpError(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, map[string]string{"error": err.Error()})
}
