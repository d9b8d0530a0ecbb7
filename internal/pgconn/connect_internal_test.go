package pgconn

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// spentDeadline is a context whose deadline has passed but whose timer has
// not yet ended it, as a loaded machine leaves one for a moment.
type spentDeadline struct{ context.Context }

func (spentDeadline) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

// A dial that failed because the caller's deadline passed is reported as
// the caller's deadline, not as connect_timeout's, even before the
// context's timer has ended it.
func TestConnectErrorUnderASpentDeadline(t *testing.T) {
	t.Parallel()
	dialErr := &os.SyscallError{Syscall: "dial", Err: os.ErrDeadlineExceeded} // a net.Error whose Timeout() is true
	ctx := spentDeadline{context.Background()}
	require.NoError(t, ctx.Err())
	err := connectError(ctx, "127.0.0.1:5432", 10*time.Second, false, 5*time.Millisecond, dialErr)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotContains(t, err.Error(), "connect_timeout")

	// Without a spent deadline, the same dial error is connect_timeout's.
	err = connectError(context.Background(), "127.0.0.1:5432", 10*time.Second, false, 10*time.Second, dialErr)
	require.ErrorContains(t, err, "connect_timeout")
	require.False(t, errors.Is(err, context.DeadlineExceeded))
}
