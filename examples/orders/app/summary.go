package app

import (
	"context"
	"fmt"
	"time"

	"github.com/millwright/millwright/outbox"
)

// Summary is the outcome of a set of orders, counted from the database.
type Summary struct {
	// Orders placed (ids matching the pattern).
	Orders int
	// Completed and Compensated count orders settled each way (status
	// completed and cancelled).
	Completed   int
	Compensated int
	// Pending orders have not settled; after the wait they are lost.
	Pending int
	// DeadLetters counts distinct messages in millwright_dead_letters
	// whose message id matches the pattern.
	DeadLetters int
	// DuplicateEffects counts effects applied more than once (rows of
	// orders_effects beyond the first per service, order and action).
	DuplicateEffects int
	// BrokenCompensations counts settled orders whose participants'
	// state contradicts the outcome: a completed order without its
	// reservation, charge and scheduled shipment, or a cancelled one that
	// still holds any of them (an effect the saga never undid, or undid
	// on an order it completed).
	BrokenCompensations int
	// Notifications counts notifications sent; UnnotifiedEvents counts
	// order events (created, plus the settlement of settled orders) that
	// got none.
	Notifications    int
	UnnotifiedEvents int
}

// String is the demo's one summary line.
func (s Summary) String() string {
	return fmt.Sprintf("orders=%d completed=%d compensated=%d dlq=%d lost=%d duplicate_effects=%d broken_compensations=%d",
		s.Orders, s.Completed, s.Compensated, s.DeadLetters, s.Pending, s.DuplicateEffects, s.BrokenCompensations)
}

// Settled reports whether every order has settled and been notified.
func (s Summary) Settled() bool { return s.Pending == 0 && s.UnnotifiedEvents == 0 }

// Count reads the summary of the orders whose id is LIKE pattern (e.g.
// "run42-%"; "%" for all). Dead letters are matched on the same pattern
// against their message id.
func (a *App) Count(ctx context.Context, pattern string) (Summary, error) {
	var s Summary
	err := a.db.queryRow(ctx, `SELECT count(*),
			count(*) FILTER (WHERE status = 'completed'),
			count(*) FILTER (WHERE status = 'cancelled'),
			count(*) FILTER (WHERE status = 'pending')
		FROM orders_orders WHERE id LIKE $1`, pattern).Scan(&s.Orders, &s.Completed, &s.Compensated, &s.Pending)
	if err != nil {
		return s, fmt.Errorf("counting orders (did the migrations run?): %w", err)
	}
	err = a.db.queryRow(ctx, `SELECT count(*) - count(DISTINCT (service, order_id, action)) FROM orders_effects WHERE order_id LIKE $1`,
		pattern).Scan(&s.DuplicateEffects)
	if err != nil {
		return s, fmt.Errorf("counting effects: %w", err)
	}
	// What each participant holds of a settled order, against its outcome.
	err = a.db.queryRow(ctx, `SELECT count(*) FROM orders_orders o
		LEFT JOIN orders_reservations r ON r.order_id = o.id
		LEFT JOIN orders_payments p ON p.order_id = o.id
		LEFT JOIN orders_shipments s ON s.order_id = o.id
		WHERE o.id LIKE $1 AND (
			(o.status = 'completed' AND (r.status IS DISTINCT FROM 'reserved' OR p.status IS DISTINCT FROM 'charged' OR s.status IS DISTINCT FROM 'scheduled'))
			OR (o.status = 'cancelled' AND (r.status = 'reserved' OR p.status = 'charged' OR s.status = 'scheduled')))`,
		pattern).Scan(&s.BrokenCompensations)
	if err != nil {
		return s, fmt.Errorf("checking compensations: %w", err)
	}
	err = a.db.queryRow(ctx, `SELECT count(DISTINCT message_uuid) FROM millwright_dead_letters WHERE message_uuid LIKE $1`,
		pattern).Scan(&s.DeadLetters)
	if err != nil {
		return s, fmt.Errorf("counting dead letters: %w", err)
	}
	err = a.db.queryRow(ctx, `SELECT
			(SELECT count(*) FROM orders_notifications WHERE order_id LIKE $1),
			(SELECT count(*) FROM orders_orders o WHERE o.id LIKE $1 AND NOT EXISTS
				(SELECT 1 FROM orders_notifications n WHERE n.order_id = o.id AND n.event_type = $2))
			+ (SELECT count(*) FROM orders_orders o WHERE o.id LIKE $1 AND o.status <> 'pending' AND NOT EXISTS
				(SELECT 1 FROM orders_notifications n WHERE n.order_id = o.id
				AND n.event_type = CASE o.status WHEN 'completed' THEN $3 ELSE $4 END))`,
		pattern, EventOrderCreated, EventOrderCompleted, EventOrderCancelled).Scan(&s.Notifications, &s.UnnotifiedEvents)
	if err != nil {
		return s, fmt.Errorf("counting notifications: %w", err)
	}
	return s, nil
}

// WaitSettled polls Count until every order matching pattern has settled
// and been notified, at least wantDeadLetters dead letters matching it are
// recorded, and the outbox has no pending row, or ctx ends. It returns the
// last summary either way, with ctx's error when it ended first: the last
// summary that was counted in full, never the zeros of a count the ending
// ctx cut short (before, a give-up read "0 of 0 pending" while orders
// were pending), and the error says which of the conditions was unmet.
func (a *App) WaitSettled(ctx context.Context, pattern string, wantDeadLetters int) (Summary, error) {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	var (
		last          Summary
		counted       bool
		outboxPending = -1 // not read yet
	)
	for {
		s, err := a.Count(ctx, pattern)
		if err != nil && ctx.Err() == nil {
			return s, err
		}
		if err == nil {
			last, counted, outboxPending = s, true, -1
			if s.Settled() && s.DeadLetters >= wantDeadLetters {
				st, err := outbox.ReadStats(ctx, a.db.handle())
				if err != nil && ctx.Err() == nil {
					return s, err
				}
				if err == nil {
					if st.Pending == 0 {
						return s, nil
					}
					outboxPending = int(st.Pending)
				}
			}
		}
		select {
		case <-ctx.Done():
			return last, notSettledError(last, counted, wantDeadLetters, outboxPending, ctx.Err())
		case <-t.C:
		}
	}
}

// notSettledError says what WaitSettled was still waiting for when its
// context ended.
func notSettledError(s Summary, counted bool, wantDeadLetters, outboxPending int, err error) error {
	if !counted {
		return fmt.Errorf("orders not settled: no count completed before the context ended: %w", err)
	}
	what := fmt.Sprintf("%d of %d pending, %d order events not notified", s.Pending, s.Orders, s.UnnotifiedEvents)
	if s.DeadLetters < wantDeadLetters {
		what += fmt.Sprintf(", %d of %d dead letters", s.DeadLetters, wantDeadLetters)
	}
	if outboxPending > 0 {
		what += fmt.Sprintf(", %d outbox rows pending", outboxPending)
	}
	return fmt.Errorf("orders not settled: %s: %w", what, err)
}
