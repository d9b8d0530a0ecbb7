package migrations

import (
	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/saga"
)

// All returns every component's migrations, in an order that satisfies
// their dependencies: outbox, idempotency, dlq, park, saga, audit.
func All() []migrate.Source {
	return []migrate.Source{outbox.Migrations(), idempotency.Migrations(), dlq.Migrations(), park.Migrations(), saga.Migrations(), Audit()}
}

// Audit returns the migrations of millwright_audit, where the operator
// CLI records who ran which state-changing command (dlq replay, outbox
// retry-failed, saga resolve, idempotency clean). Apply it with the others
// so those commands work against your database.
func Audit() migrate.Source { return audit.Migrations() }
