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

// AppName is the application_name of the benchmark's connections.
const AppName = "millwright-bench outbox"

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
		prev := map[int]string{} // a session's last statement before COMMIT
		for {
			select {
			case <-sctx.Done():
				return
			case <-t.C:
			}
			holder, age, err := h.sample(sctx, conn, prev)
			now := time.Now()
			dt := now.Sub(last)
			last = now
			if err != nil {
				continue
			}
			h.total += dt
			h.held[holder] += dt
			h.longst[holder] = max(h.longst[holder], age)
		}
	}()
	return h, nil
}

// sample names the session holding the horizon now: whose (this
// benchmark's, by application_name, or another's), and its statement (for
// one committing, the statement it ran before COMMIT, as last sampled).
func (h *horizonSampler) sample(ctx context.Context, conn *sql.Conn, prev map[int]string) (string, time.Duration, error) {
	rows, err := conn.QueryContext(ctx, `SELECT a.pid, a.application_name = '`+AppName+`', a.datname::text,
	left(regexp_replace(a.query, '\s+', ' ', 'g'), 24) || COALESCE(' .. ' || substring(a.query from '(watermill_[A-Za-z]+|millwright_[a-z_]+)'), ''),
	a.backend_xid = s.x, COALESCE(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8
FROM pg_stat_activity a, (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::xid AS x) s
WHERE a.pid <> pg_backend_pid() AND (a.application_name = '`+AppName+`' OR a.backend_xid = s.x)`)
	if err != nil {
		return "", 0, err
	}
	defer rows.Close()
	holder, age := "(none running, or a prepared transaction)", time.Duration(0)
	for rows.Next() {
		var (
			pid        int
			ours       bool
			db, q      string
			held       sql.NullBool
			ageSeconds float64
		)
		if err := rows.Scan(&pid, &ours, &db, &q, &held, &ageSeconds); err != nil {
			return "", 0, err
		}
		committing := strings.HasPrefix(q, "COMMIT")
		if ours && !committing && !strings.HasPrefix(q, "BEGIN") {
			prev[pid] = q
		}
		if !held.Bool {
			continue
		}
		who := "another session (database " + db + ")"
		if ours {
			who = "this benchmark"
		}
		if committing && prev[pid] != "" {
			q = "COMMIT after " + prev[pid]
		}
		holder, age = who+": "+q, time.Duration(ageSeconds*float64(time.Second))
	}
	return holder, age, rows.Err()
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
