package retention_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/retention"
)

// Run on a schema without its table fails at once, naming the table and
// the fix (before, it logged the failed round every Interval and went
// on).
func TestRunWithoutTheTableFailsAtOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t) // no things table
	c, err := retention.New(s.Pool(t, pgtest.DriverPgx), table, retention.Config{Interval: 10 * time.Millisecond})
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	select {
	case err = <-errc:
	case <-time.After(bound):
		require.NoError(t, c.Close())
		t.Fatalf("Run without its table was still running after %s; it returned %v once closed", bound, <-errc)
	}
	for _, want := range []string{"things", "millwright migrate", s.Name, "test: cleaner"} {
		require.ErrorContains(t, err, want)
	}
	require.NoError(t, c.Close())
}
