package outboxbench

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"strings"
	"time"
)

// horizonSampler reads, every horizonEvery on a connection of its own,
// which transaction holds the server's xmin horizon, by the holder's last
// statement: watermill-sql's consumers read only rows below the horizon,
// so on the sql kind the time a row waits after its commit is the time
// the transactions older than it take to end, whoever runs them (this
// benchmark, or any session on the server).
type horizonSampler struct {
	stop   func()
	done   chan struct{}
	held   map[string]time.Duration // holder -> time seen holding it
	total  time.Duration
	longst map[string]time.Duration // holder -> its longest hold seen
}

const horizonEvery = 2 * time.Millisecond

func startHorizonSampler(ctx context.Context, db *sql.DB) (*horizonSampler, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	h := &horizonSampler{stop: cancel, done: make(chan struct{}), held: map[string]time.Duration{}, longst: map[string]time.Duration{}}
	go func() {
		defer close(h.done)
		defer conn.Close()
		t := time.NewTicker(horizonEvery)
		defer t.Stop()
		last := time.Now()
		for {
			select {
			case <-sctx.Done():
				return
			case <-t.C:
			}
			var holder string
			var age float64
			err := conn.QueryRowContext(sctx, `SELECT COALESCE(a.datname || ': ' || left(regexp_replace(a.query, '\s+', ' ', 'g'), 70), ''),
	COALESCE(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8
FROM (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::xid AS x) s
LEFT JOIN pg_stat_activity a ON a.backend_xid = s.x AND a.pid <> pg_backend_pid()`).Scan(&holder, &age)
			now := time.Now()
			dt := now.Sub(last)
			last = now
			if err != nil {
				continue
			}
			h.total += dt
			if holder == "" {
				holder = "(none running, or a prepared transaction)"
			}
			h.held[holder] += dt
			h.longst[holder] = max(h.longst[holder], time.Duration(age*float64(time.Second)))
		}
	}()
	return h, nil
}

// rows stops the sampler and returns the top holders, by time held.
func (h *horizonSampler) rows(kind string) []Row {
	h.stop()
	<-h.done
	type kv struct {
		k string
		d time.Duration
	}
	var xs []kv
	for k, d := range h.held {
		xs = append(xs, kv{k, d})
	}
	sort.Slice(xs, func(i, j int) bool { return xs[i].d > xs[j].d })
	var out []Row
	for i, x := range xs {
		if i == 5 {
			break
		}
		out = append(out, Row{Case: "latency " + kind, Unit: "% of run",
			Variant: fmt.Sprintf("xmin horizon held by %s (oldest seen %.0f ms)", strings.TrimSpace(x.k), ms(h.longst[x.k])),
			Value:   100 * float64(x.d) / float64(max(h.total, 1))})
	}
	return out
}
