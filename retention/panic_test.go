package retention

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// A round of Run that panics is recovered, logged with its table and
// counted (millwright_loop_panics_total{component="test.Cleaner"}), and
// Run goes on: the next round cleans. Before, the panic ended the process.
func TestRunSurvivesAPanickingRound(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	_, err := s.DB.Exec(`CREATE TABLE things (id BIGSERIAL PRIMARY KEY, done BOOLEAN NOT NULL, at TIMESTAMPTZ NOT NULL);
		INSERT INTO things (done, at) SELECT true, now() - interval '2 hours' FROM generate_series(1, 5)`)
	require.NoError(t, err)
	table := Table{Component: "test", Rows: "things",
		Store: storage.RetentionTable{Name: "things", Key: "id", OrderBy: "id",
			Where: `done AND at < now() - $1 * interval '1 millisecond'`, LockClass: 0x74657375},
		DefaultRetention: time.Hour, MinRetention: time.Millisecond}
	reg := prometheus.NewRegistry()
	logs := watermill.NewCaptureLogger()
	c, err := New(storage.NewSQLPool(s.DB), table, Config{Interval: 10 * time.Millisecond, Registerer: reg, Logger: logs})
	require.NoError(t, err)
	var rounds atomic.Int64
	c.beforeRound = func() {
		if rounds.Add(1) == 1 {
			panic("boom in the first round")
		}
	}
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			require.NoError(t, c.Close())
			require.NoError(t, <-errc)
		}
	}
	defer stop()
	poll.Until(t, time.Minute, func() bool {
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM things`).Scan(&n))
		return n == 0
	}, "the round after the panic cleans")
	require.GreaterOrEqual(t, rounds.Load(), int64(2))
	n, err := testutil.GatherAndCount(reg, runner.MetricPanics)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1.0, testutil.ToFloat64(c.guard.Panics()))
	stop() // the capture logger's map is read once Run, which writes it, has returned
	found := false
	for _, e := range logs.Captured()[watermill.ErrorLogLevel] {
		found = found || (strings.Contains(e.Msg, "recovered from a panic cleaning things") && e.Fields["table"] == "things")
	}
	require.True(t, found, "the panic is logged with its table")
}
