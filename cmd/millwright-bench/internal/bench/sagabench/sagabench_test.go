package sagabench_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/sagabench"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
)

// scratch makes schemas on the test server, dropped at the end of the test.
func scratch(t *testing.T) (*sql.DB, func(context.Context, string) (string, string, func(), error)) {
	admin, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	admin.SetMaxOpenConns(2)
	t.Cleanup(func() { admin.Close() })
	return admin, func(ctx context.Context, prefix string) (string, string, func(), error) {
		var b [5]byte
		_, _ = rand.Read(b[:])
		name := prefix + "_" + hex.EncodeToString(b[:])
		if _, err := admin.ExecContext(ctx, `CREATE SCHEMA `+name); err != nil {
			return "", "", nil, err
		}
		drop := func() { _, _ = admin.ExecContext(context.Background(), `DROP SCHEMA `+name+` CASCADE`) }
		t.Cleanup(drop)
		return name, pgtest.WithSearchPath(pgtest.BaseURL(), name), drop, nil
	}
}

// A small run on gochannel gives a throughput and a latency row with
// figures, the three hops of each, and the ceiling; the JSON is one
// object per row, and the table labels dtm's figure as external. With two
// rounds each row is the worse round (the lower rate, the higher p99) and
// lists both.
func TestRunGoChannel(t *testing.T) {
	t.Parallel()
	admin, scr := scratch(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := sagabench.Run(ctx, sagabench.Config{
		Admin: admin, Scratch: scr,
		OpenBroker: func(kind transport.Kind) (sagabench.Broker, error) {
			return sagabench.Broker{Config: transport.Config{Kind: kind}, Label: "in-process"}, nil
		},
		Kinds: []transport.Kind{transport.GoChannel}, Sagas: 30, Starters: 4,
		LatencySagas: 5, LatencyRate: 50, CeilingFor: 200 * time.Millisecond, Rounds: 2,
	})
	require.NoError(t, err)
	var runs, hops, ceilings int
	drivers := map[string]int{}
	for _, r := range rep.Rows {
		switch r.Row {
		case sagabench.RowRun:
			runs++
			require.Positive(t, r.Rate, r)
			require.Positive(t, r.P50, r)
			require.GreaterOrEqual(t, r.P99, r.P50, r)
			require.InDelta(t, r.P99/r.P50, r.P99OverP50, 1e-9)
			require.Positive(t, r.RelayBatches, r)
			require.GreaterOrEqual(t, r.TxPerSaga, 4.0, r)
			// Start, then three replies: each at least one round trip.
			require.GreaterOrEqual(t, r.RoundTrips, 4.0, r)
			drivers[r.Driver]++
			if r.Driver == sagabench.DriverPgx {
				require.Positive(t, r.VsPQ, "a pgx run is compared with pq's: %+v", r)
			} else {
				require.Zero(t, r.VsPQ, r)
			}
			require.InDelta(t, 1.0, r.VsGoChannel, 1e-9, "gochannel is its own baseline")
			require.Equal(t, 2, r.Rounds)
			require.Len(t, r.RoundRates, 2)
			require.Len(t, r.RoundP99s, 2)
			if r.Run == "throughput" {
				require.Positive(t, r.OfCeiling, r)
				require.Equal(t, min(r.RoundRates[0], r.RoundRates[1]), r.Rate, "the worse of two rounds")
			} else {
				require.Equal(t, max(r.RoundP99s[0], r.RoundP99s[1]), r.P99, "the worse of two rounds")
			}
		case sagabench.RowHop:
			hops++
			if strings.HasPrefix(r.Hop, "relay: ") {
				require.Equal(t, sagabench.DriverPQ, r.Driver, "the relay's statements are timed on pq only")
				require.Positive(t, r.Calls, r)
			} else {
				require.Contains(t, sagabench.Hops, r.Hop)
			}
			require.Positive(t, r.Max, r)
		case sagabench.RowCeiling:
			ceilings++
			require.Equal(t, 4, r.Writers)
			require.Positive(t, r.CommitsPerS)
		}
	}
	require.Equal(t, []int{4, 1}, []int{runs, ceilings}, "throughput and latency on each of pq and pgx, and the ceiling")
	require.Equal(t, map[string]int{"pq": 2, "pgx": 2}, drivers)
	require.GreaterOrEqual(t, hops, 4*4+2*2, "four hops per run, and the relay's claim and mark per pq run")

	var js bytes.Buffer
	require.NoError(t, rep.WriteJSON(&js))
	sc := bufio.NewScanner(&js)
	lines := 0
	for sc.Scan() {
		var row map[string]any
		require.NoError(t, json.Unmarshal(sc.Bytes(), &row), sc.Text())
		require.Equal(t, "saga", row["bench"])
		lines++
	}
	require.Equal(t, len(rep.Rows), lines)

	var table strings.Builder
	require.NoError(t, rep.WriteTable(&table))
	require.Contains(t, table.String(), "P99/P50")
	require.Contains(t, table.String(), "RT/SAGA")
	require.Contains(t, table.String(), "database ceiling:")
	require.Contains(t, table.String(), "external figure, not measured here: dtm")
	require.Contains(t, table.String(), "gochannel on pq, linear saga, throughput: ")
	require.Contains(t, table.String(), "gochannel on pgx, linear saga, latency: ")
}

// Each shape runs its sagas to completion; the parallel and versions runs
// are compared with the linear one of the same driver and run, and the
// parallel saga's hops are timed like the linear one's (the group's two
// commands from the start, ship's from the reply that completed the
// group).
func TestRunShapes(t *testing.T) {
	t.Parallel()
	admin, scr := scratch(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := sagabench.Run(ctx, sagabench.Config{
		Admin: admin, Scratch: scr,
		OpenBroker: func(kind transport.Kind) (sagabench.Broker, error) {
			return sagabench.Broker{Config: transport.Config{Kind: kind}, Label: "in-process"}, nil
		},
		Kinds: []transport.Kind{transport.GoChannel}, Drivers: []string{sagabench.DriverPgx}, Sagas: 20, Starters: 4,
		LatencySagas: 5, LatencyRate: 50,
		Shapes: []string{sagabench.ShapeLinear, sagabench.ShapeParallel, sagabench.ShapeVersions},
	})
	require.NoError(t, err)
	shapes := map[string]int{}
	hops := map[string]int{}
	for _, r := range rep.Rows {
		switch r.Row {
		case sagabench.RowRun:
			shapes[r.Shape]++
			require.Positive(t, r.Rate, r)
			if r.Shape == sagabench.ShapeLinear {
				require.Zero(t, r.VsLinear, r)
			} else {
				require.Positive(t, r.VsLinear, "compared with the linear run: %+v", r)
			}
		case sagabench.RowHop:
			if !strings.HasPrefix(r.Hop, "relay: ") {
				hops[r.Shape]++
				require.Positive(t, r.Max, r)
			}
		}
	}
	require.Equal(t, map[string]int{"linear": 2, "parallel": 2, "versions": 2}, shapes, "throughput and latency of each shape")
	require.Equal(t, map[string]int{"linear": 8, "parallel": 8, "versions": 8}, hops, "four hops per run of each shape")
	var table strings.Builder
	require.NoError(t, rep.WriteTable(&table))
	require.Contains(t, table.String(), "VS LINEAR")
}

func TestConfigShapes(t *testing.T) {
	t.Parallel()
	_, err := sagabench.Run(context.Background(), sagabench.Config{Kinds: []transport.Kind{transport.GoChannel}, Shapes: []string{"diamond"}})
	require.ErrorContains(t, err, `--shapes "diamond": want linear, parallel or versions`)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := sagabench.Run(context.Background(), sagabench.Config{Kinds: []transport.Kind{transport.Kafka}, Sagas: -1})
	require.ErrorContains(t, err, "Config.Admin and Config.Scratch are required")
	require.ErrorContains(t, err, "--sagas -1")
	require.ErrorContains(t, err, "kind kafka needs Config.OpenBroker")
}
