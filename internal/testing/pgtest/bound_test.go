package pgtest_test

import (
	"context"
	"database/sql"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
)

// poolLimit is what pgtest.New gives each schema's pool.
const poolLimit = pgtest.MaxOpenConns

// TestPoolsStayBoundedUnderLoad runs a representative heavy workload, the
// idempotency middleware in Transactional mode (one transaction held per
// message), from far more goroutines than connections, on several
// schemas at once, while a sampler watches each pool and the server's
// pg_stat_activity. Each pool stays at its limit (goroutines wait instead),
// and the server stays well under max_connections.
func TestPoolsStayBoundedUnderLoad(t *testing.T) {
	t.Parallel()
	const (
		schemas    = 3
		goroutines = 64 // per schema, > poolLimit
		messages   = 300
	)
	admin, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	admin.SetMaxOpenConns(1)
	defer admin.Close()
	var maxConns int
	require.NoError(t, admin.QueryRow(`SELECT current_setting('max_connections')::int`).Scan(&maxConns))

	pools := make([]*sql.DB, schemas)
	for i := range pools {
		s := pgtest.New(t, idempotency.Migrations())
		require.Equal(t, poolLimit, s.DB.Stats().MaxOpenConnections, "pgtest pools are bounded")
		pools[i] = s.DB
	}

	// Sampler: pool sizes and the server's client backends.
	var (
		peakPool, peakServer atomic.Int64
		samples              atomic.Int64
		stop                 = make(chan struct{})
		sampled              = make(chan struct{})
	)
	go func() {
		defer close(sampled)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			for _, p := range pools {
				if n := int64(p.Stats().OpenConnections); n > peakPool.Load() {
					peakPool.Store(n)
				}
			}
			var n int64
			if admin.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'`).Scan(&n) == nil && n > peakServer.Load() {
				peakServer.Store(n)
			}
			samples.Add(1)
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()

	var wg sync.WaitGroup
	errs := make(chan error, schemas*goroutines)
	for i, db := range pools {
		store, err := idempotency.NewPostgresStore(postgres.From(db))
		require.NoError(t, err)
		mw, err := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "load", Registerer: prometheus.NewRegistry()})
		require.NoError(t, err)
		h := mw.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := idempotency.TxFromContext(msg.Context())
			_, err := tx.SQL().ExecContext(msg.Context(), `SELECT pg_sleep(0.002)`)
			return nil, err
		})
		var next atomic.Int64
		for range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for n := next.Add(1); n <= messages; n = next.Add(1) {
					msg := message.NewMessage(watermill.NewUUID(), nil)
					msg.Metadata.Set(metadata.EventID, fmt.Sprintf("s%d-e%d", i, n))
					msg.SetContext(context.Background())
					if _, err := h(msg); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(stop)
	<-sampled
	close(errs)
	require.NoError(t, <-errs)

	var waited int64
	for _, p := range pools {
		st := p.Stats()
		waited += st.WaitCount
		require.LessOrEqual(t, st.MaxOpenConnections, poolLimit)
	}
	require.Positive(t, samples.Load())
	require.Positive(t, waited, "the load exceeded the pools, so goroutines waited for connections")
	require.LessOrEqual(t, peakPool.Load(), int64(poolLimit), "a pool went over its limit")
	// Worst case for the whole suite: go test runs GOMAXPROCS packages at
	// once, each GOMAXPROCS parallel tests, each one pgtest pool plus its
	// 2-connection admin pool.
	procs := runtime.GOMAXPROCS(0)
	worst := procs * procs * (poolLimit + 2)
	t.Logf("max_connections %d; peak per pool %d of %d; peak client backends on the server %d (%.0f%%, other packages' tests included); worst case of the suite %d (%d packages x %d tests x %d)",
		maxConns, peakPool.Load(), poolLimit, peakServer.Load(), 100*float64(peakServer.Load())/float64(maxConns), worst, procs, procs, poolLimit+2)
	require.Less(t, peakServer.Load(), int64(maxConns)*9/10, "the server came within 10%% of max_connections")
}

// TestSchemaSessionsAreBounded: a test's connections end a transaction
// left idle and a statement that runs too long, so no test can hold the
// server (and the xmin horizon watermill-sql consumers read below).
func TestSchemaSessionsAreBounded(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	for setting, want := range map[string]time.Duration{
		"idle_in_transaction_session_timeout": pgtest.IdleInTransactionTimeout,
		"statement_timeout":                   pgtest.StatementTimeout,
	} {
		var got string
		require.NoError(t, s.DB.QueryRow(`SELECT current_setting($1)`, setting).Scan(&got))
		require.Equal(t, fmt.Sprintf("%dms", want.Milliseconds()), normalizeMs(t, got), setting)
	}
}

// normalizeMs turns Postgres's display of a duration ("1min", "2min",
// "60s") into milliseconds.
func normalizeMs(t *testing.T, v string) string {
	var n int64
	var unit string
	_, err := fmt.Sscanf(v, "%d%s", &n, &unit)
	require.NoError(t, err, v)
	mult := map[string]int64{"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000}[unit]
	require.NotZero(t, mult, "unit of %q", v)
	return fmt.Sprintf("%dms", n*mult)
}
