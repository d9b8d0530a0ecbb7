package storagetest

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("cleaner", exerciseCleaner) }

// things is a retention table of the contracts: done rows older than the
// retention go.
var things = storage.RetentionTable{
	Name: "things", Key: "id", OrderBy: "id",
	Where:     `done AND at < now() - $1 * interval '1 millisecond'`,
	LockClass: 0x73746f72,
}

// exerciseCleaner checks the retention operations.
func exerciseCleaner(t *testing.T, setup func(t *testing.T) Setup) {
	t.Run("DeleteRetainedInBatches", func(t *testing.T) {
		t.Parallel()
		cleanerDeleteRetainedInBatches(t, setup)
	})
	t.Run("DeleteRetainedSkipsLockedRows", func(t *testing.T) {
		t.Parallel()
		cleanerDeleteRetainedSkipsLockedRows(t, setup)
	})
	t.Run("RetentionLockIsExclusivePerSchema", func(t *testing.T) {
		t.Parallel()
		cleanerRetentionLockIsExclusivePerSchema(t, setup)
	})
	t.Run("SessionTransaction", func(t *testing.T) {
		t.Parallel()
		cleanerSessionTransaction(t, setup)
	})
}

// thingsSetup is the setup of the cleaner contracts.
func thingsSetup(t *testing.T, setup func(t *testing.T) Setup) Setup {
	ctx := context.Background()
	s := setup(t)
	// pgx prepares a batch's statements before it runs the first: the
	// table is created before the batch that fills it.
	_, err := s.Pool.Exec(ctx, storage.S(`CREATE TABLE things (id bigserial PRIMARY KEY, done bool NOT NULL, at timestamptz NOT NULL)`))
	require.NoError(t, err)
	require.NoError(t, s.Pool.Batch(ctx,
		storage.S(`INSERT INTO things (done, at) SELECT true, now() - interval '2 hours' FROM generate_series(1, 12)`),
		storage.S(`INSERT INTO things (done, at) SELECT false, now() - interval '2 hours' FROM generate_series(1, 3)`),
		storage.S(`INSERT INTO things (done, at) SELECT true, now() FROM generate_series(1, 4)`)))
	return s
}

func cleanerDeleteRetainedInBatches(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s := thingsSetup(t, setup)
	n, err := storage.CountRetained(ctx, s.Pool, things, time.Hour)
	require.NoError(t, err)
	require.EqualValues(t, 12, n)
	var got []int64
	for {
		n, err := storage.DeleteRetained(ctx, s.Pool, things, time.Hour, 5)
		require.NoError(t, err)
		got = append(got, n)
		if n < 5 {
			break
		}
	}
	require.Equal(t, []int64{5, 5, 2}, got, "at most limit rows a statement")
	var left int64
	require.NoError(t, s.Pool.QueryRow(ctx, storage.S(`SELECT count(*) FROM things`), &left))
	require.EqualValues(t, 7, left, "rows not done and recent rows stay")
}

func cleanerDeleteRetainedSkipsLockedRows(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s := thingsSetup(t, setup)
	tx, err := s.Pool.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // test
	_, err = tx.Exec(ctx, storage.S(`SELECT id FROM things ORDER BY id LIMIT 2 FOR UPDATE`))
	require.NoError(t, err)
	n, err := storage.DeleteRetained(ctx, s.Pool, things, time.Hour, 100)
	require.NoError(t, err, "does not wait on the locked rows")
	require.EqualValues(t, 10, n)
}

func cleanerRetentionLockIsExclusivePerSchema(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s := thingsSetup(t, setup)
	a, err := storage.AcquireSession(ctx, s.Pool)
	require.NoError(t, err)
	defer a.Release()
	b, err := storage.AcquireSession(ctx, s.Pool)
	require.NoError(t, err)
	defer b.Release()
	ok, err := storage.TryRetentionLock(ctx, a, things)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = storage.TryRetentionLock(ctx, b, things)
	require.NoError(t, err)
	require.False(t, ok, "another session of the same schema")

	other := setup(t) // another schema
	c, err := storage.AcquireSession(ctx, other.Pool)
	require.NoError(t, err)
	defer c.Release()
	ok, err = storage.TryRetentionLock(ctx, c, things)
	require.NoError(t, err)
	require.True(t, ok, "a session of another schema")
	require.NoError(t, storage.RetentionUnlock(ctx, c, things))

	require.NoError(t, storage.RetentionUnlock(ctx, a, things))
	ok, err = storage.TryRetentionLock(ctx, b, things)
	require.NoError(t, err)
	require.True(t, ok, "free once unlocked")
	require.NoError(t, storage.RetentionUnlock(ctx, b, things))
}

func cleanerSessionTransaction(t *testing.T, setup func(t *testing.T) Setup) {
	ctx := context.Background()
	s := thingsSetup(t, setup)
	sess, err := storage.AcquireSession(ctx, s.Pool)
	require.NoError(t, err)
	defer sess.Release()
	var pid, inTx int64
	require.NoError(t, sess.QueryRow(ctx, storage.S(`SELECT pg_backend_pid()`), &pid))
	tx, err := sess.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, tx.QueryRow(ctx, storage.S(`SELECT pg_backend_pid()`), &inTx))
	require.Equal(t, pid, inTx, "the transaction runs on the session's connection")
	_, err = storage.DeleteRetained(ctx, tx, things, time.Hour, 100)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	n, err := storage.CountRetained(ctx, sess, things, time.Hour)
	require.NoError(t, err)
	require.EqualValues(t, 12, n, "rolled back")
	sess.Release()
	sess.Release() // idempotent
}
