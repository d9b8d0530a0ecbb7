// Package health serves liveness and readiness for processes that run
// millwright components: outbox relays, Watermill routers, saga
// orchestrators, and the database and broker they need.
//
// Liveness (/healthz) says the process is alive: it answers 200 as long as
// the HTTP server runs, and checks nothing else. A database outage must not
// fail liveness, or the orchestrator restarts every replica at once and
// the outage becomes a crash loop; it fails readiness instead.
//
// Readiness (/readyz) runs every registered Checker concurrently, each
// bounded by Config.CheckTimeout, and answers 200 when all pass, 503 when
// one fails or the process is draining (Handler.Drain). Requests that
// arrive while the checks run share that run's results, so a flood of
// probes runs each check once at a time (a database ping holds one
// connection, not one per request); with Config.CacheFor, a run's results
// also answer the requests of the following CacheFor. The body lists
// each check, in the format of Kubernetes' own /readyz?verbose:
//
//	[+]database ok
//	[-]relay-0 failed: last successful round 2m3s ago (limit 30s)
//	readyz check failed
//
// The checks for millwright's components:
//
//   - Relay: ready once Run started and its last successful round
//     (relay.Relay.LastSuccess) is at most MaxAge old. A round that finds
//     nothing to publish is a success: an idle relay stays ready.
//   - Router: ready while the Watermill router runs (Running closed,
//     IsRunning true) and is not closed.
//   - Orchestrator: ready while the saga orchestrator's Run loop runs
//     (Running closed) and it has not been closed.
//   - Ping: ready while a Pinger (a *sql.DB) answers.
//   - Waiting: not ready while the process waits for something as it
//     starts, saying "waiting for the broker" with the last failure; feed
//     it transport.Config.OnWait (transport.Open waits for an unreachable
//     broker), and call Done once the transport is open. Serve readiness
//     before opening the transport, so that probes see the wait.
//
// Use it in a service's own process:
//
//	h, err := health.NewHandler(health.Config{})
//	if err != nil {
//		return err
//	}
//	h.Add("database", health.Ping(db))
//	h.Add("router", health.Router(router))
//	h.Add("relay", health.Relay(relay, time.Minute))     // *relay.Relay
//	h.Add("orders-saga", health.Orchestrator(orchestrator)) // *saga.Orchestrator
//	mux.Handle("/healthz", h.Live())
//	mux.Handle("/readyz", h.Ready())
//
// `millwright relay` serves the same endpoints for the relays it runs.
package health
