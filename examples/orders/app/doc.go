// Package app is the order workflow of millwright's example: the services
// behind `go run ./examples/orders`, importable so that tests (and readers)
// can run them in process on any transport.
//
// The order service (PlaceOrder, Handler) writes an order and its
// order.created.v1 event in one transaction through the outbox. The
// orchestrator starts one order_fulfilment saga per order.created.v1:
// reserve stock (inventory), charge the payment (billing), schedule the
// shipment (shipping); a failure compensates the earlier steps in reverse
// (refund, release), a timeout the timed-out step too (cancel the
// shipment), and the order settles as completed or cancelled with
// order.completed.v1 or order.cancelled.v1. The notification service reads
// the same order events in its own consumer group (fan-out).
//
//	pool, err := postgres.OpenPgx(ctx, url) // or app.Config{DB: db} with a *sql.DB (lib/pq)
//	if err != nil { ... }
//	a, err := app.New(app.Config{Pgx: pool, DatabaseURL: url, Transport: tr})
//	if err != nil { ... }
//	proc, err := a.Start(ctx)            // every service, or a.Start(ctx, app.Billing)
//	if err != nil { ... }
//	defer proc.Stop()
//	http.ListenAndServe(":8080", a.Handler()) // POST /orders, GET /orders/{id}, GET /metrics
//
// # Guarantees
//
// Every consumer runs behind dlq.NewMiddleware (recover, retry, dead-letter),
// or with Config.Park behind package park (a failing key parked and retried
// in order while the others go on), and the idempotency middleware, and writes its effect, its ledger row
// (orders_effects) and its reply or follow-up event through the outbox in
// the idempotency transaction: an effect is applied once per event however
// often the event is delivered, and a reply exists if and only if the effect
// does. Compensations are idempotent by business state. A step that runs
// after its timeout (its service was down) is undone: its late success
// makes the orchestrator send its compensation again, for every step; the
// release and refund also leave a tombstone when they find nothing to undo,
// so a late reserve or charge is refused outright. Count reads the outcome from the database: orders by
// status, effects applied more than once, dead letters.
package app
