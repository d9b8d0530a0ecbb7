package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/transporttest"
)

// Kill-run sizes: orders placed one every killOrderEvery while the
// consumers' process is SIGKILLed and restarted killTimes times.
const (
	killOrders     = 120
	killOrderEvery = 50 * time.Millisecond
	killTimes      = 3
)

// killRun is what one run under kills measured, from the database.
type killRun struct {
	summary   app.Summary
	latencies []time.Duration // created_at to settled_at, per order
	reordered []string        // orders whose settle notification came before their created one
	kills     int
}

func (r killRun) percentile(p float64) time.Duration {
	if len(r.latencies) == 0 {
		return 0
	}
	s := slices.Clone(r.latencies)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

// TestOrdersUnderKillsKeyParallel runs the order workflow as separate
// processes, `orders serve relay` and `orders serve dlq inventory billing
// shipping notify orchestrator` with park in every consumer
// (MILLWRIGHT_ORDERS_PARK=true, app.Config.Park), and SIGKILLs the consumers' process
// killTimes times while orders are placed, restarting it at once, each
// restart on the other version of the order saga (1: reserve, charge,
// ship; 2: reserve and charge at once, then ship), so that every kill is
// also a deploy with the other version's orders in flight. It runs
// twice at the same time on each broker, on its own schema and topics:
// with the key-parallel consumers (MILLWRIGHT_<KIND>_KEY_PARALLELISM=16)
// and with the one-at-a-time ones. From the database, each run must end
// with every order settled and notified (nothing lost), no effect applied
// twice, no order whose participants contradict its outcome (a charge or
// reservation of a cancelled order never undone), orders on both saga
// versions, no dead letter, and (key-parallel) no order's events applied out
// of order: its created notification before its completed or cancelled
// one. The order latency (created to settled) p50 and p99 of both runs and
// their ratio are logged, not asserted: a timed bound would be a flaky test
// on a loaded machine (issue 40 asks for the key-parallel p99 within twice
// the one-at-a-time one; read it from this test's log).
func TestOrdersUnderKillsKeyParallel(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("separate processes killed under load: not in -short")
	}
	bin := pgconntest.Build(t, ".")
	for _, kind := range []transport.Kind{transport.AMQP, transport.Kafka, transport.NATS} {
		t.Run(string(kind), func(t *testing.T) {
			var keyed, single killRun
			t.Run("runs", func(t *testing.T) {
				t.Run("key-parallel", func(t *testing.T) {
					t.Parallel()
					keyed = runUnderKills(t, bin, kind, true)
				})
				t.Run("one-at-a-time", func(t *testing.T) {
					t.Parallel()
					single = runUnderKills(t, bin, kind, false)
				})
			})
			if t.Failed() {
				return
			}
			kp99, sp99 := keyed.percentile(0.99), single.percentile(0.99)
			t.Logf("%s under %d kills each: order latency p50/p99 key-parallel %s/%s, one-at-a-time %s/%s; p99 ratio %.2f (issue 40: want at most 2)",
				kind, killTimes, keyed.percentile(0.5).Round(time.Millisecond), kp99.Round(time.Millisecond),
				single.percentile(0.5).Round(time.Millisecond), sp99.Round(time.Millisecond), float64(kp99)/float64(max(sp99, time.Millisecond)))
		})
	}
}

// service is one `orders serve` process.
type service struct {
	cmd    *exec.Cmd
	out    *syncBuffer
	exited chan struct{}
}

func startService(t *testing.T, bin string, env, args []string, names ...string) *service {
	t.Helper()
	s := &service{out: &syncBuffer{}, exited: make(chan struct{})}
	s.cmd = exec.Command(bin, append(append([]string{"serve"}, names...), args...)...)
	s.cmd.Env = env
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	require.NoError(t, s.cmd.Start())
	go func() { _ = s.cmd.Wait(); close(s.exited) }()
	t.Cleanup(func() { s.kill() })
	return s
}

// kill SIGKILLs the process and waits for it; it reports whether the
// process died of the SIGKILL (false: it had exited before).
func (s *service) kill() bool {
	select {
	case <-s.exited:
		return false
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.exited
	ws, ok := s.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// runUnderKills runs one run; see TestOrdersUnderKillsKeyParallel.
func runUnderKills(t *testing.T, bin string, kind transport.Kind, keyed bool) killRun {
	schema := pgtest.New(t, app.AllMigrations()...)
	var b [4]byte
	_, _ = rand.Read(b[:])
	run := "kill" + hex.EncodeToString(b[:])
	prefix := run + "."
	topics := app.NewTopics(prefix)

	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		for _, k := range []string{transport.EnvAMQPKeyParallelism, transport.EnvKafkaKeyParallelism, transport.EnvNATSKeyParallelism, transport.EnvNATSAckWait, transport.EnvTransport, transport.EnvDeclareGroups, "MILLWRIGHT_ORDERS_TOPIC_PREFIX", "MILLWRIGHT_ORDERS_PARK", "MILLWRIGHT_ORDERS_SAGA_VERSION"} {
			if strings.HasPrefix(kv, k+"=") {
				return true
			}
		}
		return false
	})
	env = append(env, "MILLWRIGHT_ORDERS_TOPIC_PREFIX="+prefix, "MILLWRIGHT_ORDERS_PARK=true")
	args := []string{"-database-url", pgtest.BaseURL(), "-schema", schema.Name, "-log", "error"}
	switch kind {
	case transport.AMQP:
		args = append(args, "-transport", transporttest.AMQPURL())
		env = append(env, transport.EnvDeclareGroups+"="+strings.Join(app.Groups, ","))
		if keyed {
			env = append(env, transport.EnvAMQPKeyParallelism+"=16")
		}
		t.Cleanup(func() { _ = amqp.DeleteTopology(transporttest.AMQPURL(), topics.All(), app.Groups...) })
	case transport.Kafka:
		args = append(args, "-transport", "kafka")
		env = append(env, transport.EnvKafkaBrokers+"="+strings.Join(transporttest.Config(t, transport.Kafka).Kafka.Brokers, ","))
		if keyed {
			env = append(env, transport.EnvKafkaKeyParallelism+"=16")
		}
	case transport.NATS:
		args = append(args, "-transport", transporttest.NATSURL())
		// A killed process's held messages come back AckWait after its
		// last in-progress acknowledgement: 5 s rather than 30 s keeps
		// the kills' cost small.
		env = append(env, transport.EnvNATSAckWait+"=5s")
		if keyed {
			env = append(env, transport.EnvNATSKeyParallelism+"=16")
		}
		t.Cleanup(func() { transporttest.DeleteNATSStreams(t, topics.All()) })
	}

	// The test places the orders (PlaceOrder writes the order and its
	// event to the outbox) and counts from the database; the relay and
	// the consumers are the separate processes.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	tr, err := transport.Open(ctx, transport.Config{Kind: transport.GoChannel})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	a, err := app.New(app.Config{DB: schema.DB, Transport: tr, TopicPrefix: prefix})
	require.NoError(t, err)
	require.NoError(t, a.Seed(ctx, map[string]int64{"book": 1_000_000, "lamp": 1_000_000}))

	startService(t, bin, env, args, "relay")
	names := []string{"dlq", "inventory", "billing", "shipping", "notify", "orchestrator"}
	// Each restart of the consumers is also a deploy of the other version
	// of the order saga (1: reserve, charge, ship; 2: reserve and charge at
	// once, then ship), while orders of the version before are in flight.
	versionEnv := func(k int) []string {
		return append(slices.Clone(env), fmt.Sprintf("MILLWRIGHT_ORDERS_SAGA_VERSION=%d", 1+k%2))
	}
	consumers := startService(t, bin, versionEnv(0), args, names...)

	// The orders are placed in killTimes+1 batches, batch j after the
	// j-th restart: the last batch is placed when only the last process
	// (version 2) runs, so some orders start on version 2 whatever the
	// broker's pace; the first kill waits for orders settled while only
	// the first process (version 1) ran.
	restarted := make(chan struct{}, killTimes)
	batch := killOrders / (killTimes + 1)
	placed := make(chan error, 1)
	go func() {
		defer close(placed)
		tick := time.NewTicker(killOrderEvery)
		defer tick.Stop()
		for i := 1; i <= killOrders; i++ {
			if i > 1 && (i-1)%batch == 0 && (i-1)/batch <= killTimes {
				select {
				case <-restarted:
				case <-ctx.Done():
					placed <- ctx.Err()
					return
				}
			}
			o := app.Order{ID: fmt.Sprintf("%s-%05d", run, i), SKU: []string{"book", "lamp"}[i%2], Qty: 1 + i%3, AmountCents: int64(1000 + 37*i), FailPayment: i%5 == 0}
			if _, err := a.PlaceOrder(ctx, o); err != nil {
				placed <- err
				return
			}
			<-tick.C
		}
	}()
	pattern := run + "-%"
	settledSome := func(n int) {
		t.Helper()
		require.Eventually(t, func() bool {
			s, err := a.Count(ctx, pattern)
			return err == nil && s.Completed+s.Compensated >= n
		}, 3*time.Minute, 100*time.Millisecond, "%d orders settled (consumers' output so far:\n%s)", n, consumers.out.String())
	}
	var r killRun
	for k := 1; k <= killTimes; k++ {
		// Kill while orders flow and some settled since the last start:
		// the consumers have work in flight.
		settledSome(k * killOrders / (2 * killTimes))
		require.True(t, consumers.kill(), "the fault: the consumers' process died of SIGKILL, not before (output:\n%s)", consumers.out.String())
		r.kills++
		consumers = startService(t, bin, versionEnv(k), args, names...)
		restarted <- struct{}{}
	}
	require.NoError(t, <-placed)

	s, err := a.WaitSettled(ctx, pattern, 0)
	require.NoError(t, err, "consumers' output:\n%s", consumers.out.String())
	r.summary = s
	rows, err := schema.DB.QueryContext(ctx, `SELECT extract(epoch FROM settled_at - created_at) FROM orders_orders WHERE id LIKE $1`, pattern)
	require.NoError(t, err)
	for rows.Next() {
		var sec float64
		require.NoError(t, rows.Scan(&sec))
		r.latencies = append(r.latencies, time.Duration(sec*float64(time.Second)))
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	rows, err = schema.DB.QueryContext(ctx, `SELECT o.id FROM orders_orders o
		JOIN orders_notifications c ON c.order_id = o.id AND c.event_type = $2
		JOIN orders_notifications s ON s.order_id = o.id AND s.event_type IN ($3, $4)
		WHERE o.id LIKE $1 AND s.sent_at < c.sent_at`, pattern, app.EventOrderCreated, app.EventOrderCompleted, app.EventOrderCancelled)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		r.reordered = append(r.reordered, id)
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())

	mode := map[bool]string{true: "key-parallel", false: "one-at-a-time"}[keyed]
	t.Logf("%s %s: %s after %d kills of the consumers; notifications out of order %d; latency p50 %s p99 %s",
		kind, mode, s, r.kills, len(r.reordered), r.percentile(0.5).Round(time.Millisecond), r.percentile(0.99).Round(time.Millisecond))
	require.Equal(t, killOrders, s.Orders)
	require.Zero(t, s.Pending, "orders lost (never settled)")
	require.Zero(t, s.UnnotifiedEvents, "order events never notified")
	require.Zero(t, s.DuplicateEffects, "effects applied twice")
	require.Zero(t, s.BrokenCompensations, "settled orders whose participants contradict the outcome (an effect never undone, or undone on a completed order)")
	require.Zero(t, s.DeadLetters, "dead letters")
	require.Equal(t, killOrders/5, s.Compensated, "every fifth order fails payment")
	var perVersion [3]int
	for _, v := range []int{1, 2} {
		require.NoError(t, schema.DB.QueryRowContext(ctx, `SELECT count(*) FROM millwright_saga_instances WHERE id LIKE $1 AND def_version = $2`, pattern, v).Scan(&perVersion[v]))
	}
	t.Logf("%s %s: orders on saga version 1: %d, on version 2: %d", kind, mode, perVersion[1], perVersion[2])
	require.Positive(t, perVersion[1], "no order ran on version 1: the deploys did not happen")
	require.Positive(t, perVersion[2], "no order ran on version 2 (the parallel group): the deploys did not happen")
	var parked int
	require.NoError(t, schema.DB.QueryRowContext(ctx, `SELECT count(*) FROM millwright_parked_messages`).Scan(&parked))
	require.Zero(t, parked, "messages left parked")
	if keyed {
		require.Empty(t, r.reordered, "an order's events applied out of order")
	}
	return r
}
