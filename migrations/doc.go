// Package migrations lists the SQL migrations of every millwright
// component in one call, for applications that apply their own migrations
// (or run migrate.Up at start-up) instead of `millwright migrate`:
//
//	_, err := migrate.Up(ctx, db, append(migrations.All(), myapp.Migrations())...)
//
// All is what `millwright migrate` applies: the outbox, idempotency,
// dead-letter and saga tables and the operator CLI's audit log
// (millwright_audit), which its state-changing commands refuse to run
// without. Each component's migrations are also available on their own
// (outbox.Migrations(), ...; Audit here). Package migrate applies them:
// versioned per component, under an advisory lock, each once.
package migrations
