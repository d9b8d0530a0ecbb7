// Package sagatest helps test sagas and their participants without
// copying millwright's fixtures.
//
// # Simulator: a saga with no database or broker
//
// Simulator runs a saga definition in memory, in the place of the
// orchestrator, its tables, the transport and the participants, and makes
// every decision with the orchestrator's own decider: the same commands,
// history rows, states and errors. The test plays the participants and
// the clock:
//
//	sim, err := sagatest.NewSimulator(orders)
//	err = sim.OnStep("charge_payment", sagatest.Fail) // or Script(func(Command) Answer)
//	err = sim.Start("order-1", Order{ID: "order-1"})
//	err = sim.RunUntilIdle() // answers every command, fires each deadline in turn
//	sim.State("order-1")     // saga.StateCompensated
//	sim.Trace("order-1")     // [reserve/forward/1 charge_payment/forward/1 reserve/compensation/1]
//
// or step by step: Succeed, Fail, Compensated, CompensationFailed and
// Reply (with a payload for OnSuccess) answer the newest command of a
// step; ReplyTo answers a given command again (a duplicate) or an older
// one (late); HandleReply takes a reply message a participant's own
// handler made; Signal and SignalEvent deliver the event a waiting step
// (Step.WaitFor) waits for, in the caller's transaction or through the
// transport; Advance moves the clock, firing the step timeouts, timers
// and retries that fall due; Resolve is the operator's action on a stuck
// saga. Parallel groups, waiting, timer and Retriable steps run as in
// the orchestrator: RunUntilIdle answers each branch's command, signals
// each wait (OnStep(wait, Silent) lets it time out) and fires each timer. Info, Data and History read an
// instance as saga.Get and saga.History would. Nothing happens between
// calls: a test is exactly reproducible and takes microseconds.
//
// Use the simulator to test a saga's definition: its order, its
// compensations, what its OnSuccess makes of replies, what happens on
// every failure, timeout, late or duplicate reply. Use Participant with
// Postgres and a broker to test the wiring around it: that participants
// consume the command topics and reply on the right topic, the outbox
// relay, the idempotency middleware, the transactions of Start and of the
// participants' effects, restarts. The simulator does not check what
// only those do (the outbox's limits on a command, concurrent
// orchestrators), and it retries compensations after their exact
// backoff, without jitter.
//
// # Participant: a scripted participant on a real broker
//
// Participant is an in-process participant whose answers a test scripts
// (succeed, fail, stay silent) and which records every command it receives;
// WaitState waits for a saga instance to reach a state:
//
//	p := sagatest.NewParticipant(pub)
//	p.Script(func(c sagatest.Command) sagatest.Answer {
//		if c.Step == "charge_payment" && c.Phase == saga.PhaseForward {
//			return sagatest.Fail
//		}
//		return sagatest.Succeed
//	})
//	router.AddConsumerHandler("payments", "payment_commands", sub, p.Handle)
//	// ... start the saga ...
//	info, err := sagatest.WaitState(ctx, db, "order-1", saga.StateCompensated)
//	// p.Commands("order-1") lists what the participants received, in order.
//
// Participant's replies use the step's default reply types
// ("<step>.succeeded", "<step>.failed", "<step>.compensated",
// "<step>.compensation_failed"); the Simulator's use the step's own.
package sagatest
