package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
)

// Two Writers with different limits and sources, in one process and at
// the same time, each check events against their own settings and stamp
// their own source; the package-level Add keeps Kafka's limit. Nothing is
// process state: this test runs in parallel with the package's others.
func TestWriter_TwoWritersWithDifferentLimitsInOneProcess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t, outbox.Migrations())
	small := newWriter(t, outbox.WriterConfig{MaxEventBytes: 4 << 10, Source: "/small"})
	large := newWriter(t, outbox.WriterConfig{Limits: transport.DefaultLimits(transport.SQL), Source: "/large"})
	require.Equal(t, 4<<10, small.Limits().MaxBytes)
	require.Equal(t, "outbox.WriterConfig.MaxEventBytes", small.Limits().Setting)
	require.Equal(t, transport.SQLMaxMessageBytes, large.Limits().MaxBytes)

	mid := bytes.Repeat([]byte("m"), 8<<10)                          // over small's limit, under Kafka's
	huge := bytes.Repeat([]byte("h"), 2*outbox.DefaultMaxEventBytes) // over Kafka's, under the sql transport's
	errs := make(chan error, 40)
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			errs <- addIn(ctx, s.DB, small, outbox.Event{Topic: "small", AggregateID: "s", Payload: []byte(`{}`)})
			err := addIn(ctx, s.DB, small, outbox.Event{Topic: "small", Payload: mid})
			if !errors.Is(err, transport.ErrMessageTooLarge) {
				errs <- err
			}
		}()
		go func() {
			defer wg.Done()
			errs <- addIn(ctx, s.DB, large, outbox.Event{Topic: "large", AggregateID: "l", Payload: mid})
			if i == 0 {
				errs <- addIn(ctx, s.DB, large, outbox.Event{Topic: "large", AggregateID: "l", Payload: huge})
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	err := addIn(ctx, s.DB, small, outbox.Event{Topic: "small", Payload: mid})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge)
	require.ErrorContains(t, err, "outbox.WriterConfig.MaxEventBytes")

	// The package-level AddOutsideTx: Kafka's default limit, whatever the Writers say.
	require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: "default", Payload: mid}))
	err = outbox.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: "default", Payload: huge})
	require.ErrorIs(t, err, transport.ErrMessageTooLarge)
	require.ErrorContains(t, err, "over the limit of 1048576")
	// A Writer's AddOutsideTx checks with the Writer's limits.
	require.ErrorIs(t, small.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: "small", Payload: mid}), transport.ErrMessageTooLarge)
	require.NoError(t, large.AddOutsideTx(ctx, postgres.From(s.DB), outbox.Event{Topic: "large", Payload: huge}))

	counts := pgtest.Column[string](t, s.DB, `SELECT topic || ' ' || count(*) || ' ' || (metadata->>'ce_source') FROM millwright_outbox GROUP BY topic, metadata->>'ce_source' ORDER BY topic`)
	require.Equal(t, []string{"default 1 " + newWriter(t, outbox.WriterConfig{}).Source(), "large 12 /large", "small 10 /small"}, counts)

	// AddToBatch and TxPublisher check with the Writer they are given.
	b := &pgx.Batch{}
	require.ErrorIs(t, small.AddToBatch(ctx, b, outbox.Event{Topic: "small", Payload: mid}), transport.ErrMessageTooLarge)
	require.NoError(t, large.AddToBatch(ctx, b, outbox.Event{Topic: "large", Payload: mid}))
	require.Equal(t, 1, b.Len())
	tx, err := s.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // probe only
	pub, err := outbox.NewTxPublisher(postgres.SQLTx(tx), outbox.PublisherConfig{Writer: small})
	require.NoError(t, err)
	require.ErrorIs(t, pub.Publish("small", message.NewMessage("m-1", mid)), transport.ErrMessageTooLarge)
	require.NoError(t, pub.Publish("small", message.NewMessage("m-2", []byte(`{}`))))
	var source string
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT metadata->>'ce_source' FROM millwright_outbox WHERE event_id = 'm-2'`).Scan(&source))
	require.Equal(t, "/small", source, "a message without a source gets the Writer's")
}

// NewWriter refuses settings it cannot use, naming them; a nil *Writer is
// the package-level Add's.
func TestNewWriter_ValidatesAndDefaults(t *testing.T) {
	t.Parallel()
	_, err := outbox.NewWriter(outbox.WriterConfig{MaxEventBytes: -2})
	require.ErrorContains(t, err, "WriterConfig.MaxEventBytes is -2")
	_, err = outbox.NewWriter(outbox.WriterConfig{Source: "%zz"})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
	require.ErrorContains(t, err, "WriterConfig.Source")

	w := newWriter(t, outbox.WriterConfig{})
	require.Equal(t, transport.DefaultLimits(""), w.Limits())
	require.Equal(t, outbox.DefaultMaxEventBytes, w.Limits().MaxBytes)
	var none *outbox.Writer
	require.Equal(t, w.Limits(), none.Limits())
	require.Zero(t, newWriter(t, outbox.WriterConfig{MaxEventBytes: -1}).Limits().MaxBytes, "-1: no size limit")

	// A nil Writer writes as Add does.
	s := pgtest.New(t, outbox.Migrations())
	require.NoError(t, s.Handles(t, pgtest.Drivers()[0]).InTx(context.Background(), func(tx postgres.Tx) error {
		return none.Add(context.Background(), tx, outbox.Event{Topic: "orders", Payload: []byte(`{}`)})
	}))
	require.Equal(t, []string{"orders"}, pgtest.Column[string](t, s.DB, `SELECT topic FROM millwright_outbox`))
	require.ErrorContains(t, w.Add(context.Background(), postgres.Tx{}, outbox.Event{Topic: "orders"}), "Writer.Add")
}

// The default source is "/" + $MILLWRIGHT_SERVICE_NAME, read when the
// Writer is built; WriterConfig.Source wins over it.
func TestNewWriter_SourceFromServiceName(t *testing.T) {
	t.Setenv(outbox.EnvServiceName, "payments")
	require.Equal(t, "/payments", newWriter(t, outbox.WriterConfig{}).Source())
	require.Equal(t, "/orders", newWriter(t, outbox.WriterConfig{Source: "/orders"}).Source())
	w := newWriter(t, outbox.WriterConfig{})
	t.Setenv(outbox.EnvServiceName, "other")
	require.Equal(t, "/payments", w.Source(), "read once, when built")
}
