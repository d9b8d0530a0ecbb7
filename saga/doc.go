// Package saga is an orchestrator for business flows that span services
// (reserve inventory, charge payment, schedule shipping) where no single
// ACID transaction can cover every step. A saga type is declared in Go as
// ordered steps; the orchestrator sends each step's command, waits for the
// participant's reply, and when a step fails or times out it runs the
// compensations of the completed steps in reverse order.
//
// # Defining
//
// Saga data is a user type D, stored as JSON with each instance:
//
//	type Order struct{ ID string; ReservationID string }
//
//	var orders = saga.MustDefine("orders",
//		saga.Step[Order]{
//			Name:    "reserve_inventory",
//			Command: func(o Order) (saga.Command, error) {
//				return saga.Command{Topic: "inventory_commands", Type: "inventory.reserve.v1", Payload: o}, nil
//			},
//			OnSuccess: func(o *Order, r saga.Reply) error { return r.Decode(&o.ReservationID) },
//			Compensation: func(o Order) (saga.Command, error) {
//				return saga.Command{Topic: "inventory_commands", Type: "inventory.release.v1", Payload: o}, nil
//			},
//			Timeout: 30 * time.Second,
//		},
//		saga.Step[Order]{Name: "charge_payment", ...},   // compensation: refund
//		saga.Step[Order]{Name: "schedule_shipping", ...}, // nothing to undo
//	)
//
// A step's reply types default to "<step>.succeeded" and "<step>.failed",
// its compensation's to "<step>.compensated" and
// "<step>.compensation_failed". Definition.Mermaid draws the saga as a
// Mermaid state diagram (see its example): render it in docs or in a
// test that keeps a checked-in diagram up to date.
//
// # Running
//
//	o, _ := saga.NewOrchestrator(db, orders, saga.Config{})
//	dedup, _ := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "orders-saga"})
//	router.AddConsumerHandler("orders-saga", o.ReplyTopic(), sub, o.HandleReply).AddMiddleware(dedup.Middleware)
//	go o.Run(ctx)    // step timeouts, compensation retries, resolved sagas
//	go relay.Run(ctx) // outbox.Relay: publishes the commands
//
//	tx, _ := db.BeginTx(ctx, nil)
//	// ... business writes ...
//	err := o.Start(ctx, tx, order.ID, Order{ID: order.ID})
//	err = tx.Commit()
//
// Participants consume their command topic and answer with ReplyEvent
// (through the outbox, in the transaction of their effect) or NewReply;
// both copy the saga keys (metadata.SagaID, SagaStep, SagaPhase,
// SagaAttempt) and set metadata.SagaReplyType. A failure reply carries its
// reason in metadata.SagaError.
//
// # Operating
//
// `millwright saga list --type orders --state stuck` lists instances,
// `millwright saga show ID` prints one with its step history (times,
// reply types, errors), and `millwright saga resolve ID [--action skip]
// [--dry-run]` hands a stuck saga back to the orchestrators.
// `millwright bench saga` measures completed sagas per second.
//
// # Guarantees
//
//   - No dual write: Start, and every transition, writes the instance row,
//     its step history and the command it causes in one transaction, the
//     command through the outbox. HandleReply writes in the idempotency
//     middleware's transaction, so the reply's processed mark commits with
//     them: a duplicate reply (same event id) does nothing.
//   - One transition per event: the instance row is updated with
//     UPDATE ... WHERE id = $1 AND version = $2. Of several orchestrator
//     instances handling replies of one saga at once, one wins; the others
//     re-read the row and find their reply no longer current.
//   - Stale replies are deterministic: a reply to a command that is not the
//     current one (its step timed out or was compensated, or another reply
//     already answered it) is recorded in the history as late_reply or
//     duplicate, counted in MetricIgnoredReplies, and acknowledged.
//   - On a failure reply, the compensations of the earlier steps run, last
//     step first; steps without a Compensation are skipped. On a timeout the
//     timed-out step is compensated too, because its effect is unknown (its
//     success may be in flight): compensations must accept a command whose
//     forward effect never happened.
//   - A compensation that fails or goes unanswered is retried after the
//     step's Retry backoff. When the budget is spent the saga becomes stuck:
//     MetricStuck is incremented and an error is logged; an operator runs
//     `millwright saga resolve ID` (Resolve) to retry it or to record it as
//     done by hand.
//   - Deadlines are columns, claimed by Run with FOR UPDATE SKIP LOCKED by
//     whichever orchestrator instance is alive: they survive restarts.
//     Killing an orchestrator at any point loses nothing: the transaction in
//     flight rolls back and its reply is redelivered, or it committed and
//     the outbox publishes the command. Participants see duplicate commands
//     only (the outbox is at least once), which their idempotency absorbs.
//
// Forward steps are not retried by the orchestrator: a participant retries
// its own work and answers failure only when the step cannot succeed.
//
// Deadlines are computed from the orchestrator's clock and compared with
// the database's; keep the clocks synchronised (NTP).
package saga
