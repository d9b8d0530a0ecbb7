package park_test

import (
	"context"
	"os"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
)

// Rows parked before migration 002 (keys and metadata as text) are
// migrated: a key keeps its text, a keyless message ("uuid:<its UUID>")
// gets the keyless lane and a real key "uuid:..." keeps its own, metadata
// and a held head's dead letter follow, and the retrier runs them.
func TestMigrationKeepsParkedRows(t *testing.T) {
	t.Parallel()
	first, err := os.ReadFile("migrations/001_parked.sql")
	require.NoError(t, err)
	v1 := migrate.Embedded("park", fstest.MapFS{"m/001_parked.sql": {Data: first}}, "m")
	s := pgtest.New(t, audit.Migrations(), dlq.Migrations(), v1)
	for _, q := range []string{
		`INSERT INTO millwright_parked_keys (handler, key, due_at, held, dead_letter_id) VALUES
			('billing', 'order/1', now(), true, 77), ('billing', 'uuid:n1', now(), false, NULL), ('billing', 'uuid:zz', now(), false, NULL)`,
		`INSERT INTO millwright_parked_messages (handler, key, message_uuid, payload, metadata) VALUES
			('billing', 'order/1', 'a1', 'one', '{"ordering_key": "order/1", "trace": "t-1"}'),
			('billing', 'order/1', 'a2', 'two', '{"ordering_key": "order/1"}'),
			('billing', 'uuid:n1', 'n1', 'keyless', '{}'),
			('billing', 'uuid:zz', 'r1', 'real', '{"ordering_key": "uuid:zz"}')`,
	} {
		_, err := s.DB.Exec(q)
		require.NoError(t, err, q)
	}
	_, err = migrate.Up(context.Background(), postgres.From(s.DB), park.Migrations())
	require.NoError(t, err)

	store := park.NewStore(postgres.From(s.DB))
	ctx := context.Background()
	ks, err := store.List(ctx, park.Filter{})
	require.NoError(t, err)
	got := map[string]park.Key{}
	for _, k := range ks {
		got[k.Key] = k
	}
	require.Len(t, got, 3)
	require.True(t, got["order/1"].Held)
	require.EqualValues(t, 77, got["order/1"].DeadLetterID)
	require.True(t, got["n1"].Keyless, "uuid:n1 held only message n1: it had no key")
	require.False(t, got["uuid:zz"].Keyless, "uuid:zz held message r1: a real key")
	msgs, err := store.Messages(ctx, "billing", "order/1")
	require.NoError(t, err)
	require.Len(t, msgs, 2)
	require.Equal(t, map[string]string{"ordering_key": "order/1", "trace": "t-1"}, msgs[0].Metadata)
	require.EqualValues(t, 77, msgs[0].DeadLetterID, "the held head's dead letter")
	require.Zero(t, msgs[1].DeadLetterID)

	// The retrier runs the migrated rows with their metadata.
	p, err := park.New(postgres.From(s.DB), park.Config{Retry: fast, PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	var mu sync.Mutex
	seen := map[string]message.Metadata{}
	_ = p.Middleware("billing")(func(m *message.Message) ([]*message.Message, error) {
		mu.Lock()
		defer mu.Unlock()
		seen[m.UUID] = m.Metadata
		return nil, nil
	})
	require.NoError(t, store.Retry(ctx, "billing", "order/1"))
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(seen) }
	for i := 0; i < 100 && count() < 4; i++ {
		_, err := p.RetryDue(ctx)
		require.NoError(t, err)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, seen, 4)
	require.Equal(t, "t-1", seen["a1"].Get("trace"))
	ks, err = store.List(ctx, park.Filter{})
	require.NoError(t, err)
	require.Empty(t, ks)
}

// The migration tags every key ('k' for a key, 'u' for a keyless lane):
// rewritten in place, key "foo" became "kfoo" while the row of a real key
// "kfoo" was still there, and the primary key refused the UPDATE (the
// order of the rows decided it), blocking the deploy. It must convert
// such keys apart.
func TestMigrationKeepsKeysTheTagWouldMakeCollide(t *testing.T) {
	t.Parallel()
	first, err := os.ReadFile("migrations/001_parked.sql")
	require.NoError(t, err)
	v1 := migrate.Embedded("park", fstest.MapFS{"m/001_parked.sql": {Data: first}}, "m")
	s := pgtest.New(t, audit.Migrations(), dlq.Migrations(), v1)
	for _, q := range []string{
		// In heap order: each row's tagged form is the text of the next.
		`INSERT INTO millwright_parked_keys (handler, key, due_at) VALUES
			('billing', 'foo', now()), ('billing', 'kfoo', now()), ('billing', 'uuid:ab', now()), ('billing', 'kuuid:ab', now())`,
		`INSERT INTO millwright_parked_messages (handler, key, message_uuid, payload, metadata) VALUES
			('billing', 'foo', 'm1', 'one', '{}'), ('billing', 'kfoo', 'm2', 'two', '{}'),
			('billing', 'uuid:ab', 'ab', 'keyless', '{}'), ('billing', 'kuuid:ab', 'm4', 'four', '{}')`,
	} {
		_, err := s.DB.Exec(q)
		require.NoError(t, err, q)
	}
	_, err = migrate.Up(context.Background(), postgres.From(s.DB), park.Migrations())
	require.NoError(t, err)
	ks, err := park.NewStore(postgres.From(s.DB)).List(context.Background(), park.Filter{})
	require.NoError(t, err)
	got := map[string]bool{}
	for _, k := range ks {
		got[k.Key] = k.Keyless
	}
	require.Equal(t, map[string]bool{"foo": false, "kfoo": false, "ab": true, "kuuid:ab": false}, got)
}
