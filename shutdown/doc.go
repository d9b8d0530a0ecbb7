// Package shutdown gives a program that runs millwright components a
// context cancelled by SIGINT or SIGTERM, and a bound on how long the
// program may take to return after that: Service for a long-running
// service (its handlers in flight get a grace to finish, 25 s by default),
// Context for a command (it stops within a second).
//
//	func main() {
//		ctx, stop, err := shutdown.Service(context.Background(), shutdown.Config{Name: "orders"})
//		if err != nil {
//			log.Fatal(err)
//		}
//		defer stop()
//		router.AddMiddleware(shutdown.Middleware) // names the handlers a forced exit waited for
//		if err := run(ctx); err != nil { // every wait takes ctx; router.Run(ctx) drains its handlers
//			log.Fatal(err)
//		}
//	}
//
// Service's grace is Config.Grace, else $MILLWRIGHT_SHUTDOWN_GRACE, else
// DefaultServiceGrace (25 s): inside Kubernetes' default
// terminationGracePeriodSeconds (30 s); keep a Watermill Router's
// CloseTimeout below it. A service whose handlers finish within it
// returns from main and exits 0.
//
// Guarantees. The context ends at the first SIGINT or SIGTERM, with
// context.Cause naming the signal ("terminated signal received"), so every
// call that takes it returns at once with an error saying what it was
// doing. Some waits cannot hear a context (a library's Close, reading a
// result a silent server never finishes, a handler that ignores its
// message's context): once the grace (Service's; Context's Grace plus
// ExtendGrace) has passed since the signal and stop has not been called,
// the process prints to stderr what it is still waiting for (the work in
// flight that Track and Middleware record, such as "handler
// charge_payment: 1 in flight, the oldest for 25s (message ...)", and the
// Postgres calls in flight on connections millwright opened, such as
// postgres.Open's) and exits with status 1. An outbox relay stopped that way leaves its batch leased;
// another relay republishes it after the lease, as after a crash. A
// parent context that ends is not a signal: nothing is forced then.
//
// DeadlinePassed tells a deadline that has passed by the clock from one
// whose timer has not fired yet, for messages that say which limit ended a
// wait.
package shutdown
