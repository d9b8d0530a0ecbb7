// Package console is millwright's operator console: an http.Handler,
// server-rendered with html/template (no JavaScript build chain; one small
// script, and every page works without it), that a service mounts under
// its own authentication, and that `millwright console` serves.
//
//	h, err := console.New(db, console.Config{
//		Authenticate: console.ContextActor, // behind the host's auth middleware (console.WithActor)
//		BasePath:     "/console",
//		SagaDiagrams: map[string]string{orderSaga.Name(): orderSaga.Mermaid()},
//	})
//	mux.Handle("/console/", authMiddleware(h))
//
// Pages: dead letters grouped by cause (dlq.Causes: the failure's
// fingerprint), by topic and by error type, each one with
// its payload (JSON pretty-printed, binary as hex), headers, CloudEvents
// attributes, trace context, attempts and stack; replay of one or a
// selection after a dry run; edit and replay. Sagas by type and state, one
// saga's timeline (with each step's duration, and drawn to scale) and its
// definition drawn as a server-rendered SVG with the instance's path marked
// (from the step graph its orchestrator recorded, saga.StepGraph; the
// Mermaid source of Config.SagaDiagrams besides); resolving a stuck saga.
// Parked keys (package park), held or retrying, with their head
// message and error; a key's messages; retry, release and skip after a dry
// run (park.RetryTx, ReleaseTx, SkipTx, what `millwright parked` runs, in
// the transaction of the audit row; a confirmation whose key's head
// changed since its dry run is refused). A dead letter's page shows its
// key's park state. The outbox backlog per topic, the relays and the lanes each holds
// (and was lent), failed rows and retry-failed. The audit table. Consumer
// lag per group and partition or queue (Config.Lag, a lag.Reader; read
// from the brokers when the page loads).
//
// Guarantees:
//
//   - Replay and edit and replay are dlq.ReplayTx, the one replay
//     `millwright dlq replay` runs too: the message (or the edited copy) is
//     queued with outbox.Add in the transaction that takes the dead letter
//     out of the dead state (it waits for a row another replay holds) and
//     writes its audit row. Of two operators editing or replaying one dead
//     letter at once, or an edit racing `millwright dlq replay`, exactly
//     one commits and only its message is ever sent; the other is told so
//     and nothing of it is queued. A relay publishes the replays (run
//     `millwright relay`). The outbox's metadata is text: a dead letter
//     whose UUID or metadata holds bytes that are not UTF-8 text (a binary
//     Kafka key or header) is shown quoted and not replayed (the refusal
//     names the key).
//   - The console imports no internal package: it reads and acts through
//     the public functions of dlq, outbox, park, saga, audit and migrate, in a
//     transaction of the selected schema (migrate.InSchema).
//   - Every state-changing request is a POST carrying a CSRF token (a
//     signed double submit: an HttpOnly SameSite=Strict cookie and its
//     HMAC with the operator's name in the form); a cross-site Origin or
//     Sec-Fetch-Site is refused; GET never changes anything.
//   - Every action is recorded in millwright_audit, with the operator
//     Config.Authenticate named, in the transaction of the action: a
//     schema without the audit table refuses actions.
//   - Every value is escaped (html/template); the Content-Security-Policy
//     allows no inline script, and frames are refused. Connection strings
//     and passwords are never shown: errors, stacks and metadata values
//     have URL passwords and secret-named parameters masked, metadata keys
//     named like a secret show a mask.
//   - The schema comes from a selector listing the schemas the console is
//     configured with (Config.Schemas, else the pool's current schema;
//     Config.AllSchemas for every schema holding millwright tables); any
//     other name is refused, and the chosen one reaches SQL only as an
//     argument of set_config.
//   - Roles (Role): a viewer reads, an operator also replays (one, a
//     selection, in bulk) and retries failed outbox rows, an admin also
//     edits and replays, discards and resolves sagas. Every route's role
//     (Handler.Routes) is checked on the server before anything else, a
//     refusal is a 403 naming the role needed, and a POST route without a
//     declared role needs admin; Config.NeverEdit topics are never
//     edited, by any role.
//   - Bulk actions over the dead letters page's filter run in batches,
//     each its own transaction through dlq.BulkBatchTx (dlq.ReplayTx for
//     each dead letter) that advances the job's cursor: an interrupted job
//     resumes after its last committed batch and handles nothing twice;
//     one audit row records the filter and the count. An edit's audit row
//     carries its diff (dlq.EditChange), secrets masked.
package console
