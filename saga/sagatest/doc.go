// Package sagatest helps test sagas and their participants without
// copying millwright's fixtures.
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
// Replies use the step's default reply types ("<step>.succeeded",
// "<step>.failed", "<step>.compensated", "<step>.compensation_failed").
package sagatest
