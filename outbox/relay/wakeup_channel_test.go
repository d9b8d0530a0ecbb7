package relay

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// NotifyChannel (Go) and notifyChannelSQL (what RetryFailed runs, the
// trigger's expression) name the same channel for every schema length, and
// the name always fits Postgres' 63 bytes; schemas of up to 45 bytes keep
// the name of the versions before.
func TestNotifyChannel_SQLAgrees(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	defer db.Close()
	for _, schema := range []string{
		"public", "a",
		strings.Repeat("s", 45), strings.Repeat("s", 46), strings.Repeat("s", 63),
		strings.Repeat("é", 22) + "x", // 45 bytes, 23 characters
		strings.Repeat("é", 23),       // 46 bytes
		strings.Repeat("é", 31) + "x", // 63 bytes
	} {
		var got string
		require.NoError(t, db.QueryRow(`SELECT `+notifyChannelSQL("$1::text"), schema).Scan(&got))
		want := NotifyChannel(schema)
		require.Equal(t, want, got, "schema of %d bytes", len(schema))
		require.LessOrEqual(t, len(want), 63, "schema of %d bytes", len(schema))
		if len(schema) <= 45 {
			require.Equal(t, "millwright_outbox:"+schema, want, "a short schema keeps its channel")
		} else {
			require.True(t, strings.HasPrefix(want, "millwright_outbox#"), want)
		}
	}
}

// longSchema creates a schema whose name is n bytes long, applies sources
// to it and returns its URL (search_path set to it).
func longSchema(t *testing.T, n int, sources ...migrate.Source) (name, url string) {
	t.Helper()
	var b [5]byte
	_, _ = rand.Read(b[:])
	name = "t_" + hex.EncodeToString(b[:]) + "_"
	name += strings.Repeat("x", n-len(name))
	require.Len(t, name, n)
	admin, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	admin.SetMaxOpenConns(1)
	_, err = admin.Exec(`CREATE SCHEMA ` + pq.QuoteIdentifier(name))
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(`DROP SCHEMA ` + pq.QuoteIdentifier(name) + ` CASCADE`)
		admin.Close()
	})
	url = pgtest.WithSessionBounds(pgtest.WithSearchPath(pgtest.BaseURL(), name))
	db, err := sql.Open("postgres", url)
	require.NoError(t, err)
	defer db.Close()
	_, err = migrate.Up(context.Background(), postgres.From(db), sources...)
	require.NoError(t, err, "migrating a schema of %d bytes", n)
	var current string
	require.NoError(t, db.QueryRow(`SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'millwright_outbox'::regclass`).Scan(&current))
	require.Equal(t, name, current, "the outbox is in the long schema")
	return name, url
}

// A schema of any length --schema accepts (up to 63 bytes) works end to
// end: a writer's insert while a relay is idle (holding the wake-up lock,
// so the trigger notifies) succeeds, and the notification wakes the relay,
// which publishes; so do RetryFailed's notification and the relays' lane
// notifications. The relays would otherwise sleep a third of their 1h
// lease: every wake-up within the test's bounds came from a
// notification. Before the fix, with 46 bytes or more, the insert failed
// with "channel name too long" (22023).
func TestRelay_LongSchemaName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		bytes   int
		sources []migrate.Source
	}{
		{45, []migrate.Source{outbox.Migrations()}},
		{46, []migrate.Source{outbox.Migrations()}},
		{63, []migrate.Source{outbox.Migrations()}},
		{63, []migrate.Source{outbox.Migrations(), outbox.PartitionedMigrations()}},
	} {
		name := fmt.Sprintf("%d_bytes", tc.bytes)
		if len(tc.sources) > 1 {
			name += "_partitioned"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testLongSchema(t, tc.bytes, tc.sources)
		})
	}
}

func testLongSchema(t *testing.T, n int, sources []migrate.Source) {
	ctx := context.Background()
	schema, url := longSchema(t, n, sources...)
	db, err := pgconn.Open(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(8)
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1000, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	b := bundle{db: db, pubsub: ps}
	got := b.collect(t, "t")

	var oid int64
	require.NoError(t, db.QueryRow(`SELECT 'millwright_outbox'::regclass::oid::int8`).Scan(&oid))
	idle := func() bool { // a relay holds the wake-up lock
		var held bool
		require.NoError(t, db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock'
			AND granted AND classid = $1 AND objid = $2 AND objsubid = 2)`, wakeLockClass, oid).Scan(&held))
		return held
	}
	logs := watermill.NewCaptureLogger()
	cfg := Config{ListenURL: url, PollInterval: time.Hour, Lease: time.Hour, Logger: logs}
	startRelay(t, db, ps, cfg)
	eventually(t, 20*time.Second, idle, "the relay went idle holding the wake-up lock (schema of %d bytes)", n)

	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(db), outbox.Event{Topic: "t", AggregateID: "a", Payload: []byte(`1`)}),
		"a business write while the relay listens (schema %q, channel %q)", schema, NotifyChannel(schema))
	eventually(t, 20*time.Second, func() bool { return len(got.all()) == 1 }, "the notification woke the relay, which published")

	// RetryFailed notifies too.
	eventually(t, 20*time.Second, idle, "the relay went idle again")
	_, err = db.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status) VALUES ('f1', 't', 'b', '2', 'failed')`)
	require.NoError(t, err)
	eventually(t, 20*time.Second, idle, "the relay went idle after the failed row's wake-up")
	retried, err := outbox.RetryFailed(ctx, postgres.From(db), outbox.FailedFilter{}, false)
	require.NoError(t, err)
	require.Len(t, retried, 1)
	eventually(t, 20*time.Second, func() bool { return len(got.all()) == 2 }, "RetryFailed's notification woke the relay")

	// A second relay gets its share of the lanes only once the first,
	// asleep, is woken by the lane notification.
	eventually(t, 20*time.Second, idle, "the relay went idle again")
	startRelay(t, db, ps, cfg)
	eventually(t, 20*time.Second, func() bool {
		var owners int
		require.NoError(t, db.QueryRow(`SELECT count(DISTINCT owner) FROM millwright_outbox_lanes WHERE owner IS NOT NULL`).Scan(&owners))
		return owners == 2
	}, "both relays hold lanes: the lane notification woke the first")

	for _, lvl := range []watermill.LogLevel{watermill.ErrorLogLevel, watermill.InfoLogLevel} {
		for _, m := range logs.Captured()[lvl] {
			if m.Err != nil {
				require.NotContains(t, m.Err.Error(), "too long", m.Msg)
			}
		}
	}
}
