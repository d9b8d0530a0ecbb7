package outbox

import (
	"embed"

	"github.com/millwright/millwright/migrate"
)

//go:embed migrations_partitioned/*.sql
var partitionedMigrationFiles embed.FS

// PartitionedComponent is the migrate component of the partitioned layout.
const PartitionedComponent = "outbox_partitioned"

// PartitionedMigrations returns the migrations that turn millwright_outbox
// into a table partitioned by UTC day on created_at, rows included. Apply
// them after Migrations(), in the same or a later migrate.Up:
//
//	migrate.Up(ctx, db, outbox.Migrations(), outbox.PartitionedMigrations())
//
// (`millwright migrate --outbox-partitioned`). The default layout, a
// plain table cleaned by batched DELETE, is what Migrations() alone
// gives. Once applied, the layout stays partitioned: there is no way back
// but by hand.
//
// On the partitioned layout Add and the relay work unchanged, and the
// outbox's cleaner (retention.NewOutboxCleaner), instead of deleting rows, creates partitions
// retention.Config.PartitionsAhead days ahead and detaches and drops the
// partitions older than retention.Config.Retention (counted from created_at)
// that hold no pending or failed row. A DEFAULT partition takes rows no
// daily partition covers, so a write never fails for want of a partition;
// the cleaner reports its rows (retention.Stats.DefaultRows). See
// docs/partitioning.md.
func PartitionedMigrations() migrate.Source {
	return migrate.Embedded(PartitionedComponent, partitionedMigrationFiles, "migrations_partitioned")
}
