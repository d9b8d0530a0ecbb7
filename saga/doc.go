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
//		saga.Step[Order]{Name: "charge_payment", ...},    // compensation: refund
//		saga.Step[Order]{Name: "schedule_shipping", ...}, // compensation: cancel
//		saga.Step[Order]{Name: "notify", NoCompensation: true, ...},
//	)
//
// Every step declares either a Compensation or NoCompensation (its effect
// is harmless to keep: a read, a notification); Define refuses a step with
// neither, naming it, because a step without a compensation keeps its
// effect even when it happens after the saga gave up.
//
// A step's reply types default to "<step>.succeeded" and "<step>.failed",
// its compensation's to "<step>.compensated" and
// "<step>.compensation_failed". Definition.Mermaid draws the saga as a
// Mermaid state diagram (see its example): render it in docs or in a
// test that keeps a checked-in diagram up to date.
//
// # Parallel branches
//
// A step whose Parallel field is set is a group: its branches, ordinary
// steps (Command, reply types, Timeout, Compensation or NoCompensation),
// run at once, and the group succeeds when every branch has:
//
//	saga.Step[Order]{Name: "fulfil", Parallel: []saga.Step[Order]{
//		{Name: "charge_payment", Command: charge, Compensation: refund, Timeout: 30 * time.Second},
//		{Name: "schedule_shipping", Command: ship, Compensation: cancel, Timeout: time.Minute},
//	}},
//
// A group sets only Name and Parallel and has at least two branches; a
// branch is not itself a group; names are unique across steps, branches and
// groups (Define names the offending field). Entering the group sends every
// branch's command in one transition; each branch has its own deadline (the
// instance's deadline is the earliest of the running ones) and its own
// replies. When a branch fails or times out, the branches still running
// are awaited (or time out); once none runs, exactly the branches that
// succeeded or timed out (effect unknown) are compensated, last declared
// first, then the steps before the group, last first. A failed branch is
// not compensated. A later step's failure compensates every branch of the
// completed group. A timed-out branch's success is undone like any late
// success: recorded as late_success and compensated with the others if the
// group still runs, or its compensation sent again if the saga already
// compensated it. Branch states are stored in the instance's branches
// column (saga migration 004) and shown by Info.Branches and `millwright
// saga show`; Definition.Mermaid draws a group as a fork and join.
//
// # Waiting, timer and Retriable steps
//
// A step with WaitFor sends no command: it waits, up to its Timeout, for
// an event of that type correlated to the saga (a manual approval, a
// payment provider's webhook). Deliver it in your own transaction, which
// also holds whatever the event changed:
//
//	saga.Step[Order]{Name: "approval", WaitFor: "approval.granted", Timeout: 48 * time.Hour,
//		OnSuccess: func(o *Order, r saga.Reply) error { return r.Decode(&o.Approval) }}
//
//	err := o.Signal(ctx, tx, orderID, "approval.granted", body) // applied iff tx commits
//
// or through the transport, with the outbox event of SignalEvent on the
// saga's reply topic (HandleReply applies it). The event is the step's
// success; its FailureReply (default "<step>.failed") rejects the step.
// The timeout compensates the earlier steps (a wait has nothing to undo).
// An event that finds the saga not waiting for it (its wait timed out, it
// came before) is recorded in the history as late_reply and ignored;
// Signal returns ErrNotWaiting instead, saying where the saga is. A
// timer step (Sleep: 10 * time.Minute, or Until: func(o Order) time.Time
// {...}) goes on when its time has come. Both are the instance's
// deadline_at, so they survive restarts; the history records them as
// kind wait and timer (timer_fired).
//
// A Retriable step is retried instead of compensated: its failure reply
// or timeout sends the command again (metadata.SagaAttempt + 1) after the
// step's Retry backoff; once Retry is spent the saga is stuck, and
// `millwright saga resolve ID` sends the command again with a fresh budget
// (--action skip: the step was done by hand, the saga goes on). A success
// of any attempt is the step's, so its participant must be idempotent. In
// the saga literature these are the steps after the pivot: Define refuses
// a Retriable step with a Compensation, and after the first Retriable step
// only Retriable steps and timers, naming the step that breaks the rule.
//
// # Running
//
//	o, _ := saga.NewOrchestrator(db, orders, saga.Config{})
//	dedup, _ := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "orders-saga"})
//	router.AddConsumerHandler("orders-saga", o.ReplyTopic(), sub, o.HandleReply).AddMiddleware(dedup.Middleware)
//	go o.Run(ctx)    // step timeouts, compensation retries, resolved sagas
//	go relay.Run(ctx) // relay.Relay: publishes the commands
//
//	tx, _ := db.BeginTx(ctx, nil)
//	// ... business writes ...
//	err := o.Start(ctx, tx, order.ID, Order{ID: order.ID})
//	err = tx.Commit()
//
// db is a *sql.DB (lib/pq, or pgx's stdlib adapter) or a *pgxpool.Pool;
// Start takes the business transaction, a *sql.Tx or a pgx.Tx (from
// pgxpool or a pgx.Conn), whichever the pool. List, Get, History and
// CountStuck read through either driver's pool, transaction or connection;
// Resolve takes either pool.
//
// Participants consume their command topic and answer with ReplyEvent
// (through the outbox, in the transaction of their effect) or NewReply;
// both copy the saga keys (metadata.SagaID, SagaStep, SagaPhase,
// SagaAttempt) and set metadata.SagaReplyType. A failure reply carries its
// reason in metadata.SagaError. A participant writes its effect and
// outbox.Add(ctx, tx, ev) in the same transaction (idempotency.TxFromContext).
//
// A transport that hands a topic's messages to its consumer one at a
// time (sql; RabbitMQ with one consumer) applies one reply at a time. Set
// Config.ReplyShards to N and consume each of o.ReplyTopics() with
// HandleReply: commands then name one of N reply topics, by saga id (all
// of a saga's replies go to the same one), and N replies are applied at
// once. Kafka's partitions already do this.
//
// # Versions
//
// An instance runs on the definition version it started on, to its end.
// Change a saga's steps (insert, remove, rename or reorder one, change a
// reply type or a compensation) under a new version, and keep the old
// one registered while its instances run:
//
//	var ordersV1 = saga.MustDefine("orders", reserve, charge, ship)   // version 1
//	ordersV2, _ := saga.DefineVersion("orders", 2, reserve, fraudCheck, charge, ship)
//	o, _ := saga.NewOrchestrator(db, ordersV2, saga.Config{
//		Versions: []saga.Versioned{ordersV1}, // any data type
//	})
//
// Start uses the orchestrator's own definition (ordersV2); HandleReply and
// Run decide each instance with its own version's steps. Each instance
// stores its version (Info.DefinitionVersion) and the fingerprint of its
// version's step graph (Definition.Fingerprint: step order, names, reply
// types, compensation or not; timeouts and retry policies may change
// freely). Before its first round Run calls CheckVersions, which refuses
// (ErrDefinitionChanged, and Start refuses too) a registered version whose
// live instances started on another graph, naming the change:
//
//	saga "orders" version 1: step "fraud_check" inserted before "charge" since the 3 running
//	instance(s) started; give the changed definition a new version (saga.DefineVersion) and
//	keep version 1 registered in Config.Versions
//
// An instance of a version the orchestrator does not run is left as it
// is, never decided by another version: Run does not claim its deadlines
// and logs its version at start-up, HandleReply returns an error wrapping
// ErrVersionNotRegistered (not permanent: during a rolling deploy a
// process that runs the version takes the redelivery). Instances from
// before versions are version 1, without a fingerprint (not checked).
// Deploy a release with versions everywhere before registering a second
// version: an orchestrator of an earlier release decides every instance
// with its own definition.
//
// A version is retired when none of its instances is running,
// compensating or stuck: Versions, `millwright saga versions` and the
// console's sagas page count the instances per version; then drop it from
// Config.Versions.
//
// # Migrating running instances
//
// Instead of waiting for old instances to end, a service may move them to
// a newer version with a declared, typed migration:
//
//	mig := saga.Migrate(ordersV1, ordersV2, func(o OrderV1, at saga.Position) (Order, saga.Position, error) {
//		return Order{ID: o.ID, Amount: o.Amount}, at, nil // or an error: it stays on version 1
//	})
//	o, _ := saga.NewOrchestrator(db, ordersV2, saga.Config{Versions: []saga.Versioned{ordersV1}, Migrations: []saga.Migration{mig}})
//	plans, _ := o.PlanMigration(ctx)                          // dry run: writes nothing
//	report, _ := o.Migrate(ctx, audit.Operator{User: "alice"}) // applies it
//
// PlanMigration lists, per live instance of the old version, where it
// stands, where it would land and what it does next, or why it stays.
// Migrate plans again and applies that plan; ApplyMigration applies a
// plan the operator reviewed. Either goes instance by instance, each in its own
// transaction: the row is locked and planned again (an instance that moved
// on since the plan stays, and the report says so), then moved, with a
// "migrated" history row and an audit row (audit.RecordTx, command "saga
// migrate"). It needs the audit table (audit.Migrations).
//
// A migration places an instance running forward, waiting for its current
// step's reply, at the step of the same name in the new version: the
// command is in flight and its reply names the step, so nothing is sent
// and the reply, when it comes, is decided by the new version. An instance
// stays on its version, and is reported with the reason, when it is
// compensating or stuck, when the function refuses it or places it at
// another step, when that step's reply types or compensation differ, or
// when a later failure would compensate differently (the new version has
// a step with a compensation before it that never ran for the instance,
// or a step that ran with a compensation is gone from before it).
//
// The CLI holds no definitions, so it cannot plan a migration: a service
// exposes PlanMigration and Migrate to its operators (an admin endpoint
// beside the console it mounts, or a subcommand of its own binary that
// builds the same orchestrator). Migration runs as that operator action
// only, never by itself at an instance's next transition: the dry run is
// there to be read before anything moves.
//
// # Operating
//
// `millwright saga list --type orders --state stuck` lists instances
// (with their definition version), `millwright saga versions` counts them
// per version,
// `millwright saga show ID` prints one with its step history (times,
// reply types, errors), and `millwright saga resolve ID [--action skip]
// [--dry-run]` hands a stuck saga back to the orchestrators. With
// Config.Registerer set, the gauge MetricStuckNow counts the sagas stuck
// now (alert MillwrightSagaStuck, docs/runbooks.md), and
// health.Orchestrator reports whether the Run loop runs (Stopped).
// `millwright-bench saga` measures completed sagas per second.
//
// # Guarantees
//
//   - No dual write: Start, and every transition, writes the instance row,
//     its step history and the command it causes in one transaction, the
//     command through the outbox. HandleReply writes in the idempotency
//     middleware's transaction, so the reply's processed mark commits with
//     them: a duplicate reply (same event id) does nothing.
//   - One transition per event: a reply's transaction reads the instance
//     row FOR UPDATE and updates it with UPDATE ... WHERE id = $1 AND
//     version = $2. Of several orchestrator instances handling replies of
//     one saga at once, one goes first; the others wait for its commit,
//     read the row it left and find their reply no longer current (the
//     version check guards the update besides).
//   - Stale replies are deterministic: a reply to a command that is not the
//     current one (its step timed out or was compensated, or another reply
//     already answered it) is recorded in the history as late_reply or
//     duplicate, counted in MetricIgnoredReplies, and acknowledged; except
//     a late success, which is undone (below).
//   - On a failure reply, the compensations of the earlier steps run, last
//     step first; NoCompensation steps are skipped. On a timeout the
//     timed-out step is compensated too, because its effect is unknown (its
//     success may be in flight): compensations must accept a command whose
//     forward effect never happened, and must be idempotent by business
//     state (a retry or a late success sends one again).
//   - A late success is undone, the same way for every step: when a step's
//     success arrives after the step timed out (its participant was down
//     past the timeout, then ran the command), the orchestrator sends that
//     step's compensation again, in the transaction that records the reply
//     (late_success in the history; the command through the outbox, so a
//     crash loses neither), once however often the success is delivered.
//     The compensation sent at the timeout is not enough: the participant
//     may have run it before the command, finding nothing to undo. The
//     late step's compensation goes first; a compensation it interrupts
//     starts again after it (a new round), and a compensated saga is
//     compensating again until it is done (MetricLateSuccesses; counted
//     compensated once). Participants need no tombstone for this; one that
//     refuses commands of sagas it already compensated answers a failure,
//     which is late and ignored. A NoCompensation step's late success is
//     recorded as late_reply and its effect kept, as declared.
//   - Each round of a step's compensation numbers its attempts
//     (metadata.SagaAttempt) after every earlier attempt of that step, so a
//     reply to an earlier attempt is never taken for a later one's answer.
//   - The saga's last error names the cause (the failure, timeout or
//     command error that started compensating, also Info.Cause) followed by
//     what went wrong since (a compensation that failed or timed out), and
//     is the cause again once the saga is compensated.
//   - A compensation that fails or goes unanswered is retried after the
//     step's Retry backoff. When the budget is spent the saga becomes stuck:
//     MetricStuck is incremented and an error is logged; an operator runs
//     `millwright saga resolve ID` (Resolve) to retry it or to record it as
//     done by hand. (A late success of a later step still undoes that step
//     at once, then retries the stuck compensation.)
//   - No instance stops the orchestrator: an instance whose position is
//     not a step of the definition (steps removed while it ran:
//     ErrUnknownPosition), or on which the definition's code panics
//     (recovered, logged with the instance and the stack, counted in
//     MetricLoopPanics), is set aside by Run as stuck, in the same batch
//     as the other deadlines: its last error says why (`millwright saga
//     list --state stuck`), its deadline is cleared, and MetricStuck
//     counts it. HandleReply refuses a reply to such an instance with a
//     failure.Permanent error (for the dead-letter path).
//   - Nor does a transition that can never be written: one whose command
//     outbox.Add refuses (outbox.ErrInvalidEvent: a payload past the
//     transport's size limit, a topic it cannot take, a NUL byte, not a
//     valid CloudEvent), or whose data (from a step's OnSuccess) the jsonb
//     column cannot hold (ErrDataNotStorable: a NUL character, \u0000, a
//     lone surrogate, a number beyond numeric; the error names the field).
//     Run and HandleReply set that instance aside as stuck instead, in the
//     same transaction, sending nothing; its last error names the refused
//     command or field and the fix, the reply is recorded and acknowledged
//     (a redelivery is a duplicate), and the other instances go on. Start
//     returns such errors to its caller.
//   - A transition is load, decide, write, in one transaction: the
//     instance row (locked), and only when the decision needs it one read
//     of the step history; then a pure decision (no I/O); then one batch,
//     one round trip on either driver, of the command's outbox rows, the
//     instance row and the history. Its errors, a version conflict
//     included, are the write's own, on every driver (nothing is held
//     until COMMIT).
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
//
// # Testing
//
// sagatest.Simulator runs a definition in memory on the orchestrator's
// own decisions, with no database or broker: the test scripts the
// participants' replies and moves a fake clock, then asserts the commands
// sent, the state, the data and the history (see its example).
// sagatest.Participant answers commands on a real broker, for tests of
// the wiring with Postgres.
//
// # Lifecycle and retention
//
// Orchestrator.Run blocks until ctx ends or Close is called; Close lets the
// round in flight finish for up to Config.CloseTimeout, then cancels it
// (its transaction rolls back and another instance fires those deadlines).
// It is idempotent; Run after Close returns at once.
//
// retention.NewSagaCleaner's cleaner deletes completed and compensated
// sagas whose last transition is older than retention.Config.Retention
// (default retention.DefaultSagaRetention, 30 days), with their step history, BatchSize sagas per statement, one
// instance per schema at a time. Running, compensating and stuck sagas are
// never deleted. A reply still arriving for a deleted saga fails
// permanently with ErrNotFound.
// `millwright saga clean --dry-run` shows what a round would delete.
package saga
