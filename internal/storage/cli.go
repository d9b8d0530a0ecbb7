package storage

import (
	"context"
	"time"

	"github.com/lib/pq"
)

// The operator CLI's own statements (cmd/millwright): schemas it creates
// and drops, and its read-only reports that no component runs.

// CreateSchema creates schema name; ifNotExists makes an existing one no
// error.
func CreateSchema(ctx context.Context, q Querier, name string, ifNotExists bool) error {
	text := `CREATE SCHEMA `
	if ifNotExists {
		text += `IF NOT EXISTS `
	}
	_, err := q.Exec(ctx, S(text+pq.QuoteIdentifier(name)))
	return err
}

// DropSchema drops schema name and everything in it, if it exists.
func DropSchema(ctx context.Context, q Querier, name string) error {
	_, err := q.Exec(ctx, S(`DROP SCHEMA IF EXISTS `+pq.QuoteIdentifier(name)+` CASCADE`))
	return err
}

// ConsumerMarks is one consumer's processed marks in
// millwright_processed_events.
type ConsumerMarks struct {
	Consumer string
	Marks    int64
	Oldest   time.Time
}

// CountMarksByConsumer reports the processed marks of every consumer, by
// consumer name (`millwright idempotency stats`).
func CountMarksByConsumer(ctx context.Context, q Querier) ([]ConsumerMarks, error) {
	var out []ConsumerMarks
	err := q.Query(ctx, S(`SELECT consumer, count(*), min(processed_at)
		FROM millwright_processed_events GROUP BY consumer ORDER BY consumer`), func(r Row) error {
		var m ConsumerMarks
		if err := r.Scan(&m.Consumer, &m.Marks, &m.Oldest); err != nil {
			return err
		}
		out = append(out, m)
		return nil
	})
	return out, err
}
