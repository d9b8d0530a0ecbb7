// Package audit records who ran which state-changing operator command,
// when, with which arguments (secrets redacted), whether it was a dry run,
// and how many rows it affected, in the millwright_audit table.
//
// The operator CLI (cmd/millwright) writes one row per run of dlq replay,
// outbox retry-failed, saga resolve and idempotency clean, after the
// command has done its work, so the row carries the real count, and also
// when the command failed half way (Error is then set).
//
//	_, err := audit.Record(ctx, db, audit.Entry{
//		Command: "millwright dlq replay", Args: audit.RedactArgs(args),
//		User: audit.CurrentUser(), Host: audit.Hostname(),
//		Affected: 3, Confirmed: "--yes",
//	})
//
// Guarantees: Record writes one row or returns an error naming the table
// and the fix (run `millwright migrate`); RedactArgs never returns a
// password, token or secret that was in a URL, a key=value DSN or the value
// of a flag whose name says it is secret.
package audit
