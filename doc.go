// Package millwright is the client of millwright's reliable event-driven
// services: one value, built from the service's database and a Config, on
// which the service registers what it does, and whose Run starts
// everything it needs, in order, and stops it again.
//
//	pool, _ := postgres.OpenPgx(ctx, url)
//	client, err := millwright.NewClient(postgres.Pgx(pool), millwright.Config{Name: "payments", Migrate: true})
//	payments, err := millwright.AddSaga(client, paymentSaga, saga.Config{})    // an orchestrator: payments.Start(ctx, tx, id, data)
//	err = client.Handle("start", "payments.submitted", start, millwright.HandlerConfig{})
//	err = client.Participant("charges", "payments.charges", charge, millwright.HandlerConfig{})
//	http.Handle("/", client.Handler())                                      // /healthz, /readyz, /metrics
//	err = client.Run(ctx)                                                   // until SIGTERM; nil when drained
//
//	// Anywhere: the business rows and their events, in one transaction.
//	err = db.InTx(ctx, func(tx postgres.Tx) error {
//		_, err := tx.Pgx().Exec(ctx, `INSERT INTO payments ...`)
//		return errors.Join(err, client.Add(ctx, tx, outbox.Event{Topic: "payments.submitted", ...}))
//	})
//
//	func charge(ctx context.Context, tx postgres.Tx, cmd *message.Message) (any, error) {
//		// tx records the command's event id: the effect commits once.
//		return nil, millwright.Refuse("over the limit") // or the reply's payload, nil
//	}
//
// # What Run starts
//
// In dependency order: it waits for the database (Config.StartTimeout,
// each failure logged; this replaces the startup loops services wrote),
// applies the migrations (Config.Migrate: millwright's, then
// Config.Migrations), opens the transport (Config.Transport, else
// MILLWRIGHT_TRANSPORT, else the sql transport on the database; waiting
// for the broker), subscribes every handler and runs the Watermill
// Router, then park's retriers (one per handler), the saga orchestrators,
// the outbox relay and the cleaners (Config.Retention). Readiness
// (HealthHandler) fails until all of it runs.
//
// # The middleware order
//
// Every handler runs behind the same middlewares, outermost first, an
// order the framework fixes: a slot among Config.MaxHandlers (each
// idempotent handler holds a database connection), tracing, park, the
// in-place retry, idempotency, the handler. Park decides on the final
// outcome of the in-place attempts (so it is outside the retry), and
// every attempt goes through the deduplication (so idempotency is
// inside). A poison message (failure.Permanent, dlq.Malformed, or a key
// still failing after Config.Park) reaches millwright_dead_letters by
// one route, park's, in the transaction that holds its key: no
// dead-letter topic, no recorder, and no dlq.Middleware around a parked
// handler. The console and `millwright dlq` list and replay them.
//
// # Shutdown
//
// When Run's context ends (SIGTERM) readiness fails at once, the router
// stops taking messages, and the handlers in flight finish: their
// contexts do not end with the subscriber's but Config.Grace (25 s,
// inside Kubernetes' 30 s) minus 2 s after the signal. Messages still
// waiting for a handler slot are nacked, never started. The relay, the
// orchestrators, the retriers and the cleaners drain beside the router;
// the transport closes last, after everything that publishes through it.
// Run returns nil when every handler finished in time, so a main that
// exits with Run's error exits 0 (TestSIGTERMLetsHandlersFinish runs a
// built service and checks it).
//
// # Every part stays usable alone
//
// The client only composes outbox.NewRelay, park.New,
// saga.NewOrchestrator, idempotency.NewMiddleware, retry, tracing,
// health and the cleaners; a service that needs another composition uses
// them directly, as examples/orders does.
package millwright
