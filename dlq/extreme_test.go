package dlq_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
)

// A dead letter whose failure times are valid RFC 3339 that Postgres
// reads only in another form (year 0000, an offset beyond ±15:59) is
// stored on both drivers, as the instants they are, and once: the
// database/sql path used to send them as Go formats them, Postgres
// refused the row (22008, 22009), and the recorder was redelivered it
// forever.
func TestDeadLetterWithExtremeValidTimesIsStored(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		store, _ := newStoreOn(t, driver)
		for _, times := range [][2]string{
			{"0000-01-01T00:00:00Z", "0000-01-01T00:00:01.5Z"},
			{"2026-01-02T03:04:05+23:00", "2026-01-02T03:04:06.123456789-23:59"},
			{"9999-12-31T23:59:58Z", "9999-12-31T23:59:59.999999+16:00"},
		} {
			msg := deadLetter("orders", "boom", time.Now())
			msg.Metadata.Set(metadata.DeadLetterFirstFailure, times[0])
			msg.Metadata.Set(metadata.DeadLetterLastFailure, times[1])
			id, err := store.Insert(ctx, msg)
			require.NoError(t, err, "%s", times)
			require.NotZero(t, id)
			again, err := store.Insert(ctx, msg)
			require.NoError(t, err, "a redelivery of %s", times)
			require.Zero(t, again, "a redelivered dead letter is stored once")
			d, err := store.Get(ctx, id)
			require.NoError(t, err)
			first, _ := time.Parse(time.RFC3339Nano, times[0])
			last, _ := time.Parse(time.RFC3339Nano, times[1])
			require.True(t, first.Truncate(time.Microsecond).Equal(d.FirstFailure), "first failure %s read back as %s", first, d.FirstFailure)
			require.Equal(t, last.UnixMicro(), d.LastFailure.UnixMicro(), "last failure %s read back as %s", last, d.LastFailure)
		}
	})
}

// A dead letter the database refuses for a value (here a column narrowed
// by hand: 22001) is a permanent error naming the refusal, on both
// drivers, never "did migrate run?": redelivering it cannot help.
func TestUnstorableDeadLetterIsPermanent(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		store, s := newStoreOn(t, driver)
		_, err := s.DB.ExecContext(ctx, `ALTER TABLE millwright_dead_letters ALTER COLUMN error TYPE varchar(3)`)
		require.NoError(t, err)
		msg := deadLetter("orders", "a longer error", time.Now())
		err = store.Record(msg)
		require.Error(t, err)
		require.True(t, failure.IsPermanent(err), "a refused value is permanent: %v", err)
		require.Contains(t, err.Error(), "cannot be stored")
		require.Contains(t, err.Error(), msg.UUID)
		require.Contains(t, err.Error(), "value too long", "the error carries the server's reason")
		require.False(t, strings.Contains(err.Error(), "migrate"), "a refused value is not a missing migration: %v", err)
		n, err := store.Count(ctx, dlq.Filter{})
		require.NoError(t, err)
		require.Zero(t, n)
	})
}
