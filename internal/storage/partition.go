package storage

import (
	"context"
	"database/sql"
	"strconv"
	"time"

	"github.com/lib/pq"
)

// Partition is one partition of a table as the catalog shows it.
type Partition struct {
	Name      string
	IsDefault bool
	// Upper is the partition's upper bound (not valid for DEFAULT).
	Upper sql.NullTime
	// Expired is whether Upper is older than the retention asked.
	Expired bool
	// Tuples is pg_class.reltuples: an estimate of its rows.
	Tuples int64
}

// partitionCatalog lists the partitions of $1 (a table name resolved on
// the search_path), expired when their upper bound is older than $2 ms.
const partitionCatalog = `SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT',
		b.upper, coalesce(b.upper <= now() - $2 * interval '1 millisecond', false), greatest(c.reltuples, 0)::int8
	FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
	CROSS JOIN LATERAL (SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz AS upper) b
	WHERE i.inhparent = $1::text::regclass
	ORDER BY b.upper NULLS LAST`

// IsPartitioned reports whether table (on the search_path) is a
// partitioned table.
func IsPartitioned(ctx context.Context, q Querier, table string) (bool, error) {
	var kind string
	if err := q.QueryRow(ctx, S(`SELECT relkind::text FROM pg_class WHERE oid = $1::text::regclass`, table), &kind); err != nil {
		return false, err
	}
	return kind == "p", nil
}

// ListPartitions returns table's partitions, by upper bound (DEFAULT
// last), with those whose bound is older than retention marked Expired.
func ListPartitions(ctx context.Context, q Querier, table string, retention time.Duration) ([]Partition, error) {
	var ps []Partition
	err := q.Query(ctx, S(partitionCatalog, table, retention.Milliseconds()), func(r Row) error {
		var p Partition
		if err := r.Scan(&p.Name, &p.IsDefault, &p.Upper, &p.Expired, &p.Tuples); err != nil {
			return err
		}
		ps = append(ps, p)
		return nil
	})
	return ps, err
}

// KeptRows counts the rows of partition that t's Keep predicates
// protect, in one statement.
func KeptRows(ctx context.Context, q Querier, t RetentionTable, partition string) (int64, error) {
	if t.Partitions == nil || len(t.Partitions.Keep) == 0 {
		return 0, nil
	}
	text := `SELECT `
	for i, pred := range t.Partitions.Keep {
		if i > 0 {
			text += ` + `
		}
		text += `(SELECT count(*) FROM ` + pq.QuoteIdentifier(partition) + ` WHERE ` + pred + `)`
	}
	var n int64
	err := q.QueryRow(ctx, S(text+`::int8`), &n)
	return n, err
}

// CountRows counts the rows of table, at most limit of them.
func CountRows(ctx context.Context, q Querier, table string, limit int64) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, S(`SELECT count(*) FROM (SELECT 1 FROM `+pq.QuoteIdentifier(table)+` LIMIT $1) d`, limit), &n)
	return n, err
}

// UTCToday returns the server's current UTC day, at midnight UTC.
func UTCToday(ctx context.Context, q Querier) (time.Time, error) {
	var today time.Time
	if err := q.QueryRow(ctx, S(`SELECT date_trunc('day', now() AT TIME ZONE 'UTC')::timestamp`), &today); err != nil {
		return time.Time{}, err
	}
	return time.Date(today.Year(), today.Month(), today.Day(), 0, 0, 0, 0, time.UTC), nil
}

// lockTimeout is the statement that bounds the lock waits of the rest of
// a transaction.
func lockTimeout(d time.Duration) Statement {
	return S(`SET LOCAL lock_timeout = ` + strconv.FormatInt(d.Milliseconds(), 10))
}

// CreatePartition creates partition name of t for [from, to) as a plain
// table LIKE t, then attaches it: ATTACH takes only SHARE UPDATE
// EXCLUSIVE on the parent (and ACCESS EXCLUSIVE on the DEFAULT
// partition, which it scans for rows of that range). tx must be a
// transaction; the three statements (lock timeout, create, attach) go in
// one batch. An ATTACH refused for rows of that range in the DEFAULT
// partition fails with SQLSTATE 23514.
func CreatePartition(ctx context.Context, tx Querier, t RetentionTable, name string, from, to time.Time, lock time.Duration) error {
	with := ""
	if t.Partitions != nil && t.Partitions.With != "" {
		with = " WITH (" + t.Partitions.With + ")"
	}
	q := pq.QuoteIdentifier(name)
	return tx.Batch(ctx,
		lockTimeout(lock),
		S(`CREATE TABLE `+q+` (LIKE `+t.Name+` INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`+with),
		S(`ALTER TABLE `+t.Name+` ATTACH PARTITION `+q+` FOR VALUES FROM (`+
			pq.QuoteLiteral(from.Format(time.RFC3339))+`) TO (`+pq.QuoteLiteral(to.Format(time.RFC3339))+`)`),
	)
}

// SetLockTimeout bounds the lock waits of the rest of transaction tx.
func SetLockTimeout(ctx context.Context, tx Querier, d time.Duration) error {
	_, err := tx.Exec(ctx, lockTimeout(d))
	return err
}

// DetachPartition detaches partition name from t inside a savepoint of
// transaction tx, in one batch: RestorePartition puts it back (rolls
// back to the savepoint), DropPartition drops it.
func DetachPartition(ctx context.Context, tx Querier, t RetentionTable, name string) error {
	return tx.Batch(ctx, S(`SAVEPOINT millwright_detach`),
		S(`ALTER TABLE `+t.Name+` DETACH PARTITION `+pq.QuoteIdentifier(name)))
}

// RestorePartition undoes the DetachPartition of tx's last savepoint.
func RestorePartition(ctx context.Context, tx Querier) error {
	_, err := tx.Exec(ctx, S(`ROLLBACK TO SAVEPOINT millwright_detach`))
	return err
}

// DropPartition drops a detached partition; the space returns at commit.
func DropPartition(ctx context.Context, tx Querier, name string) error {
	_, err := tx.Exec(ctx, S(`DROP TABLE `+pq.QuoteIdentifier(name)))
	return err
}
