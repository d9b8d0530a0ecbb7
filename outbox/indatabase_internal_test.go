package outbox

import (
	"context"
	"database/sql"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/internal/poll"
	tsql "github.com/millwright/millwright/transport/sql"
)

func inDatabaseBundle(t *testing.T) (*pgtest.Schema, *tsql.Transport) {
	t.Helper()
	s := pgtest.New(t, Migrations())
	s.DB.SetMaxOpenConns(10)
	tr, err := tsql.Open(context.Background(), tsql.Config{DB: s.DB}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return s, tr
}

// TestMove_StalledRelayLosesItsBatchAfterLease: a relay stops in the
// middle of its in-database publish, rows claimed and copied, transaction
// open. After
// Lease the server ends that transaction; another relay then publishes the
// rows, and the stalled relay's copy never commits: each event is in the
// topic's table once.
func TestMove_StalledRelayLosesItsBatchAfterLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, tr := inDatabaseBundle(t)
	topic := "stall_" + watermill.NewShortUUID()
	for i := range 5 {
		require.NoError(t, Add(ctx, s.DB, Event{Topic: topic, AggregateID: "a", Payload: []byte(`{"i":` + string(rune('0'+i)) + `}`)}))
	}

	// Lease: long enough for the other relay's first claim to come while
	// the stalled one still holds the rows on a loaded machine.
	stalled, err := NewRelay(s.DB, tr.Publisher(), RelayConfig{Lease: 2 * time.Second})
	require.NoError(t, err)
	require.NoError(t, stalled.prepareTopics(ctx, []string{topic}))
	other, err := NewRelay(s.DB, tr.Publisher(), RelayConfig{})
	require.NoError(t, err)
	require.NoError(t, other.prepareTopics(ctx, []string{topic}))
	_, err = other.prepare(ctx, &other.moveStmt, moveSQL)
	require.NoError(t, err)
	resume := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(resume) }) }
	t.Cleanup(release) // before the schema is dropped: never leave the stalled relay holding locks
	claimed := make(chan struct{})
	stalled.beforeMoveCommit = func() { close(claimed); <-resume }
	stalledDone := make(chan int, 1)
	go func() { n, _ := stalled.RunOnce(ctx); stalledDone <- n }()
	select {
	case <-claimed:
	case n := <-stalledDone:
		t.Fatalf("the stalled relay returned (%d rows) without publishing in the database", n)
	case <-time.After(30 * time.Second):
		t.Fatal("the stalled relay never claimed in the database")
	}

	n, held, err := other.move(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	require.True(t, held, "the stalled relay holds the rows")
	poll.Until(t, 30*time.Second, func() bool {
		n, _, err := other.move(ctx)
		require.NoError(t, err)
		return n > 0
	}, "the other relay never got the stalled relay's rows")
	release()
	require.Zero(t, <-stalledDone, "the server ended the stalled relay's transaction: it published nothing")

	var copies, published int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*), count(DISTINCT uuid) FROM "watermill_`+topic+`"`).Scan(&copies, &published))
	require.Equal(t, 5, copies)
	require.Equal(t, 5, published)
	require.Zero(t, count(t, s.DB, "status <> 'published'"))
}

// TestMove_RowsBehindABackingOffHeadAreNotHeld: rows written behind an
// aggregate's head that is backing off are due but cannot be claimed
// until it is: a relay that finds nothing else does not report them as
// held by other relays (it would look again every few milliseconds for the
// whole backoff); a head locked by another relay's claim is held.
func TestMove_RowsBehindABackingOffHeadAreNotHeld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, tr := inDatabaseBundle(t)
	topic := "held_" + watermill.NewShortUUID()
	require.NoError(t, Add(ctx, s.DB, Event{Topic: topic, AggregateID: "a", Payload: []byte(`{}`)}))
	_, err := s.DB.Exec(`UPDATE millwright_outbox SET next_attempt_at = now() + interval '1 hour', retry_count = 1`)
	require.NoError(t, err)
	require.NoError(t, Add(ctx, s.DB, Event{Topic: topic, AggregateID: "a", Payload: []byte(`{}`)}))

	r, err := NewRelay(s.DB, tr.Publisher(), RelayConfig{})
	require.NoError(t, err)
	rows, moved, held, err := r.take(ctx)
	require.NoError(t, err)
	require.Empty(t, rows)
	require.Zero(t, moved)
	require.False(t, held, "a row behind a backing-off head is not held by a relay")

	require.NoError(t, Add(ctx, s.DB, Event{Topic: topic, AggregateID: "b", Payload: []byte(`{}`)}))
	tx, err := s.DB.Begin()
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck
	_, err = tx.Exec(`SELECT id FROM millwright_outbox WHERE aggregate_id = 'b' FOR UPDATE`)
	require.NoError(t, err)
	rows, moved, held, err = r.take(ctx)
	require.NoError(t, err)
	require.Empty(t, rows)
	require.Zero(t, moved)
	require.True(t, held, "a head another transaction has locked is held")
}

// TestSameDatabase: two pools on one database (different search paths)
// are the same database; a pool on another database of the same server is
// not.
func TestSameDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t, Migrations())
	base, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = base.Close() })
	same, err := sameDatabase(ctx, s.DB, base)
	require.NoError(t, err)
	require.True(t, same)

	tokyo, err := url.Parse(s.URL)
	require.NoError(t, err)
	q := tokyo.Query()
	q.Set("timezone", "Asia/Tokyo") // lib/pq sends unknown parameters as session settings
	tokyo.RawQuery = q.Encode()
	other, err := sql.Open("postgres", tokyo.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close() })
	var tz string
	require.NoError(t, other.QueryRowContext(ctx, `SHOW TimeZone`).Scan(&tz))
	require.Equal(t, "Asia/Tokyo", tz)
	same, err = sameDatabase(ctx, s.DB, other)
	require.NoError(t, err)
	require.True(t, same, "the session's TimeZone does not change the database")

	u, err := url.Parse(pgtest.BaseURL())
	require.NoError(t, err)
	u.Path = "/template1" // in every cluster, open to connections by default
	template, err := sql.Open("postgres", u.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = template.Close() })
	if err := template.PingContext(ctx); err != nil {
		t.Skipf("no second database to compare with: %v", err)
	}
	same, err = sameDatabase(ctx, s.DB, template)
	require.NoError(t, err)
	require.False(t, same)
}
