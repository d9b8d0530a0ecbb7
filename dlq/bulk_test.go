package dlq_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

// A bulk replay of 5,000 dead letters matching a filter, interrupted
// halfway and resumed, with a relay and a consumer running: the dry run's
// count is the count replayed and the count the consumer applied, each
// dead letter once; one audit row names the filter and the count.
func TestBulkReplayOverAFilterInterruptedAndResumedReplaysEachOnce(t *testing.T) {
	t.Parallel()
	const n = 5000
	s := pgtest.New(t, dlq.Migrations(), outbox.Migrations(), audit.Migrations())
	db := s.DB
	ctx := context.Background()
	_, err := db.Exec(`CREATE TABLE applied (seq BIGSERIAL PRIMARY KEY, replay_of BIGINT NOT NULL)`)
	require.NoError(t, err)
	// n dead letters the filter selects, and others it does not: another
	// topic, another error on the same topic.
	insert := func(count int, topic, errText string) {
		_, err := db.Exec(`INSERT INTO millwright_dead_letters (message_uuid, original_topic, dlq_topic, first_failure_at, last_failure_at, payload, error, error_type)
			SELECT $2 || '-' || g, $2, $2 || '.dlq', now(), now(), convert_to('{"n":' || g || '}', 'UTF8'), $3, '*errors.errorString'
			FROM generate_series(1, $1) g`, count, topic, errText)
		require.NoError(t, err)
	}
	insert(n/2, "orders", "ledger down: connection refused")
	insert(7, "orders", "bad quantity")
	insert(5, "invoices", "ledger down: connection refused")
	insert(n-n/2, "orders", "ledger down: connection refused")
	filter := dlq.Filter{Topic: "orders", ErrorContains: "LEDGER DOWN"}

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = broker.Close() })
	rel, err := relay.New(postgres.From(db), broker, relay.Config{PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	relayDone := make(chan error, 1)
	go func() { relayDone <- rel.Run(ctx) }()
	t.Cleanup(func() { _ = rel.Close(); <-relayDone })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("ledger", "orders", broker, func(m *message.Message) error {
		_, err := db.ExecContext(m.Context(), `INSERT INTO applied (replay_of) VALUES ($1)`, m.Metadata.Get(metadata.DeadLetterReplayOf))
		return err
	})
	rctx, stopRouter := context.WithCancel(ctx)
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(rctx) }()
	t.Cleanup(func() { stopRouter(); <-routerDone })
	<-router.Running()

	// The dry run.
	plan, err := dlq.PlanBulk(ctx, postgres.From(db), filter, 10)
	require.NoError(t, err)
	require.Equal(t, n, plan.Count)
	require.Len(t, plan.Sample, 10)
	for _, d := range plan.Sample {
		require.Equal(t, "orders", d.OriginalTopic)
	}
	by := audit.Operator{User: "ola", Host: "console"}
	var id int64
	require.NoError(t, postgres.From(db).InTx(ctx, func(tx postgres.Tx) error {
		_, err := dlq.StartBulkTx(ctx, tx, dlq.BulkReplay, filter, plan, n-1, by)
		require.ErrorIs(t, err, dlq.ErrOverCap, "a cap under the count is refused")
		return nil
	}))
	require.NoError(t, postgres.From(db).InTx(ctx, func(tx postgres.Tx) error {
		id, err = dlq.StartBulkTx(ctx, tx, dlq.BulkReplay, filter, plan, n, by)
		return err
	}))
	// A dead letter recorded after the dry run is not part of it.
	insert(1, "orders", "ledger down: connection refused (late)")

	// Interrupted halfway: the run's context ends after a batch.
	runCtx, interrupt := context.WithCancel(ctx)
	job, err := dlq.RunBulk(runCtx, postgres.From(db), id, dlq.BulkRunOptions{By: by, Batch: 100, Progress: func(j dlq.BulkJob) {
		if j.Done >= n/2 {
			interrupt()
		}
	}})
	require.True(t, errors.Is(err, context.Canceled), "the run was interrupted: %v", err)
	require.Equal(t, n/2, job.Done)
	stored, err := dlq.GetBulkJob(ctx, postgres.From(db), id)
	require.NoError(t, err)
	require.Equal(t, "running", stored.State, "an interrupted job stays to resume")
	require.Equal(t, n/2, stored.Done)
	queued := func() int {
		return pgtest.Column[int](t, db, `SELECT count(*)::int FROM millwright_outbox`)[0]
	}
	require.Equal(t, n/2, queued(), "exactly the committed batches were queued")
	require.Empty(t, pgtest.Column[string](t, db, `SELECT command FROM millwright_audit`), "the audit row comes with the end")

	// Resumed.
	job, err = dlq.RunBulk(ctx, postgres.From(db), id, dlq.BulkRunOptions{By: by, Batch: 100})
	require.NoError(t, err)
	require.Equal(t, "done", job.State)
	require.Equal(t, n, job.Done, "dry-run count = replayed count")
	require.Zero(t, job.Skipped)
	require.Equal(t, n, queued(), "nothing queued twice")
	// Once more: nothing left to do.
	job, err = dlq.RunBulk(ctx, postgres.From(db), id, dlq.BulkRunOptions{By: by})
	require.NoError(t, err)
	require.Equal(t, n, job.Done)
	require.Equal(t, n, queued())

	poll.Until(t, 120*time.Second, func() bool {
		return pgtest.Column[int](t, db, `SELECT count(*)::int FROM applied`)[0] >= n
	}, "the consumer applies the replays")
	counts := pgtest.Column[string](t, db, `SELECT count(*)::text || ' ' || count(DISTINCT replay_of)::text FROM applied`)
	require.Equal(t, []string{"5000 5000"}, counts, "each applied once")
	require.Equal(t, []int{0}, pgtest.Column[int](t, db, `SELECT count(*)::int FROM applied a JOIN millwright_dead_letters d ON d.id = a.replay_of
		WHERE d.original_topic <> 'orders' OR d.error NOT ILIKE '%ledger down%' OR d.error LIKE '%(late)'`), "only the filter's rows")
	left := pgtest.Column[string](t, db, `SELECT original_topic || ' ' || error || ' ' || count(*) FROM millwright_dead_letters WHERE state = 'dead'
		GROUP BY original_topic, error ORDER BY original_topic, error`)
	require.Equal(t, []string{
		"invoices ledger down: connection refused 5",
		"orders bad quantity 7",
		"orders ledger down: connection refused (late) 1",
	}, left)

	rows := pgtest.Column[string](t, db, `SELECT os_user || ' | ' || command || ' | ' || array_to_string(args, ' ') || ' | ' || affected FROM millwright_audit`)
	require.Equal(t, []string{"ola | bulk replay dead letters | --topic=orders --error-contains=LEDGER DOWN --job=" +
		itoa(id) + " --planned=5000 --cap=5000 --skipped=0 | 5000"}, rows, "one audit row with the filter and the count")
}

func itoa(i int64) string { return strconv.FormatInt(i, 10) }
