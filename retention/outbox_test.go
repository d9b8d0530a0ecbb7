package retention_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
)

func TestCleaner_DeletesOnlyOldPublishedRowsUnderConcurrentWrites(t *testing.T) {
	t.Parallel()
	b := setupOutbox(t)
	ctx := context.Background()
	var evs []outbox.Event
	for i := 0; i < 300; i++ {
		evs = append(evs, outbox.Event{Topic: "t", AggregateID: fmt.Sprint(i % 7), Payload: []byte(`{}`)})
	}
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
	// 250 old published, 20 recently published, 20 pending, 10 failed (old).
	_, err := b.db.Exec(`UPDATE millwright_outbox SET status = 'published', published_at = now() - interval '8 days' WHERE id <= (SELECT min(id) + 249 FROM millwright_outbox)`)
	require.NoError(t, err)
	_, err = b.db.Exec(`UPDATE millwright_outbox SET status = 'published', published_at = now() - interval '1 day' WHERE id IN (SELECT id FROM millwright_outbox WHERE status = 'pending' ORDER BY id LIMIT 20)`)
	require.NoError(t, err)
	_, err = b.db.Exec(`UPDATE millwright_outbox SET status = 'failed', created_at = now() - interval '30 days' WHERE id IN (SELECT id FROM millwright_outbox WHERE status = 'pending' ORDER BY id LIMIT 10)`)
	require.NoError(t, err)

	c, err := retention.NewOutboxCleaner(postgres.From(b.db), retention.Config{BatchSize: 7})
	require.NoError(t, err)

	// Writers keep adding while the cleaner deletes; the clean starts once
	// one of them has written.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var written [3]int
	wrote := make(chan struct{})
	var firstWrite sync.Once
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "w"}); err != nil {
					t.Error(err)
					return
				}
				written[w]++
				firstWrite.Do(func() { close(wrote) })
			}
		}()
	}
	select {
	case <-wrote:
	case <-time.After(10 * time.Second):
		close(stop)
		wg.Wait()
		t.Fatal("no writer wrote within 10s")
	}
	stats, err := c.RunOnce(ctx)
	close(stop)
	wg.Wait()
	require.NoError(t, err)
	require.Positive(t, written[0]+written[1]+written[2], "the writers wrote")
	require.EqualValues(t, 250, stats.Deleted)
	require.Equal(t, 20, count(t, b.db, "status = 'published'"))
	require.Equal(t, 10, count(t, b.db, "status = 'failed'"))
	require.Equal(t, 20+written[0]+written[1]+written[2], count(t, b.db, "status = 'pending'"))
}

func TestCleaner_OneInstanceAtATime(t *testing.T) {
	t.Parallel()
	b := setupOutbox(t)
	ctx := context.Background()
	conn, err := b.db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `SELECT pg_advisory_lock($1, hashtext(current_schema()))`, storage.OutboxRetention.LockClass)
	require.NoError(t, err)
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	_, err = b.db.Exec(`UPDATE millwright_outbox SET status = 'published', published_at = now() - interval '8 days'`)
	require.NoError(t, err)

	c, err := retention.NewOutboxCleaner(postgres.From(b.db), retention.Config{})
	require.NoError(t, err)
	stats, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Skipped: true}, stats)

	_, err = conn.ExecContext(ctx, `SELECT pg_advisory_unlock($1, hashtext(current_schema()))`, storage.OutboxRetention.LockClass)
	require.NoError(t, err)
	stats, err = c.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 1, Batches: 1}, stats)
}

func TestCleaner_RunAndClose(t *testing.T) {
	t.Parallel()
	b := setupOutbox(t)
	require.NoError(t, outbox.AddOutsideTx(context.Background(), postgres.From(b.db), outbox.Event{Topic: "t", AggregateID: "a"}))
	_, err := b.db.Exec(`UPDATE millwright_outbox SET status = 'published', published_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	c, err := retention.NewOutboxCleaner(postgres.From(b.db), retention.Config{Retention: time.Hour, Interval: 10 * time.Millisecond})
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	<-c.Running()
	poll.Until(t, 30*time.Second, func() bool { return count(t, b.db, "true") == 0 }, "cleaner deletes the old row")
	require.NoError(t, c.Close())
	require.NoError(t, <-errc)
	require.NoError(t, c.Close(), "Close is idempotent")
}

// TestCleaner_OnEveryDriver: retention.NewOutboxCleaner on a *sql.DB and on a
// *pgxpool.Pool deletes the old published rows, in batches, and keeps
// pending, failed and recent ones.
func TestCleaner_OnEveryDriver(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupOutbox(t)
		ctx := context.Background()
		var evs []outbox.Event
		for i := 0; i < 20; i++ {
			evs = append(evs, outbox.Event{Topic: "t", AggregateID: fmt.Sprint(i), Payload: []byte(`{}`)})
		}
		require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...))
		// 12 old published, 3 recently published, 3 old failed, 2 pending.
		_, err := b.db.Exec(`UPDATE millwright_outbox SET status = 'published', published_at = now() - interval '8 days' WHERE id < (SELECT min(id) + 12 FROM millwright_outbox);
			UPDATE millwright_outbox SET status = 'published', published_at = now() WHERE id IN (SELECT id FROM millwright_outbox WHERE status = 'pending' ORDER BY id LIMIT 3);
			UPDATE millwright_outbox SET status = 'failed', created_at = now() - interval '30 days' WHERE id IN (SELECT id FROM millwright_outbox WHERE status = 'pending' ORDER BY id LIMIT 3)`)
		require.NoError(t, err)
		c, err := retention.NewOutboxCleaner(b.schema.Handles(t, driver), retention.Config{BatchSize: 5})
		require.NoError(t, err)
		n, err := c.Count(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 12, n)
		stats, err := c.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, retention.Stats{Deleted: 12, Batches: 3}, stats)
		var left string
		require.NoError(t, b.db.QueryRow(`SELECT string_agg(status || '=' || n, ',' ORDER BY status) FROM (SELECT status, count(*) n FROM millwright_outbox GROUP BY status) s`).Scan(&left))
		require.Equal(t, "failed=3,pending=2,published=3", left)
	})
}

// outboxBundle is a schema with the outbox's tables.
type outboxBundle struct {
	db     *sql.DB
	schema *pgtest.Schema
}

func setupOutbox(t *testing.T) outboxBundle {
	s := pgtest.New(t, outbox.Migrations())
	return outboxBundle{db: s.DB, schema: s}
}

func count(t *testing.T, db *sql.DB, where string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE `+where).Scan(&n))
	return n
}
