package app_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/pubsub/pstest"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
	tramqp "github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/embedded"
	"github.com/millwright/millwright/transport/transporttest"
)

// EnvSoakOrders sets the number of orders of every transport's reliability
// run (e.g. 500 for a soak); by default each kind places a number that keeps
// the whole suite within a few minutes on a small machine.
const EnvSoakOrders = "MILLWRIGHT_SOAK_ORDERS"

// defaultOrders per kind, which keep the suite at about two minutes under
// -race on two busy cores. 500 pass on every kind (MILLWRIGHT_SOAK_ORDERS);
// pstest delivers one message per ordering key at a time and caps at about
// 800 msg/s, so it gets fewer by default.
var defaultOrders = map[transport.Kind]int{
	transport.GoChannel:   100,
	transport.SQL:         100,
	transport.Kafka:       100,
	transport.AMQP:        100,
	transport.GoogleCloud: 50,
	transport.NATS:        100,
}

// amqpURL is the RabbitMQ the tests use (MILLWRIGHT_TEST_AMQP_URL or the local one).
var amqpURL = transporttest.AMQPURL()

// faults says how a kind's "broker refuses publishes" fault is made.
type faults struct {
	// refuse starts refusing publishes for d; nil: wrap the relay's
	// publisher instead.
	refuse func(d time.Duration)
	// refused counts the publish requests (or connections) the broker
	// refused.
	refused func() int64
	// relayUnaffected: the outage cannot reach the relay's publishes (sql:
	// the relay publishes in the database, not through the transport's
	// connections), so only the consumers' cut connections prove it.
	relayUnaffected bool
}

// TestReliability runs the order workflow on every transport kind while
// faults are injected, and checks from the database that nothing was lost
// and nothing applied twice:
//
//   - the first relay is killed in the middle of its first batch (its
//     context cancelled and its publisher failing from the n-th message on,
//     so the rows it published are never marked and wait out the lease);
//   - the broker refuses publishes for a few seconds: kfake fails every
//     Produce request (Kafka); a TCP proxy in front of the server closes the
//     transport's connections and refuses new ones (RabbitMQ, Postgres: the
//     shared server itself stays up for other tests); pstest answers Publish
//     with UNAVAILABLE (Pub/Sub); gochannel has no broker (and AMQP under
//     -race, see race_on_test.go), so a publisher wrapped around the
//     relay's fails every publish instead;
//   - every message is delivered twice to every consumer (Duplicator);
//   - one poison (malformed) command is published.
//
// Kafka and Pub/Sub run twice: on the real broker (transporttest finds the
// ones scripts/services.sh starts), where the outage is made at the relay's
// publisher, and on the in-process fake, whose broker-side refusals only a
// fake can inject ("kafka-kfake", "googlecloud-pstest").
//
// The services run on database/sql (lib/pq); gochannel and sql run once
// more with the services on pgx ("gochannel-pgx", "sql-pgx").
func TestReliability(t *testing.T) {
	type variant struct {
		name   string
		kind   transport.Kind
		fake   bool   // the in-process fake, for its broker-side faults
		driver string // of the services: pgtest.DriverPQ or DriverPgx
	}
	var variants []variant
	for _, kind := range []transport.Kind{transport.GoChannel, transport.SQL, transport.Kafka, transport.AMQP, transport.GoogleCloud, transport.NATS} {
		switch {
		case kind == transport.Kafka || kind == transport.GoogleCloud:
			if transporttest.Real(kind) {
				variants = append(variants, variant{string(kind), kind, false, pgtest.DriverPQ})
			}
			fakeName := map[transport.Kind]string{transport.Kafka: "kafka-kfake", transport.GoogleCloud: "googlecloud-pstest"}[kind]
			variants = append(variants, variant{fakeName, kind, true, pgtest.DriverPQ})
		default:
			variants = append(variants, variant{string(kind), kind, false, pgtest.DriverPQ},
				variant{string(kind) + "-pgx", kind, false, pgtest.DriverPgx})
		}
	}
	for _, v := range variants {
		kind := v.kind
		t.Run(v.name, func(t *testing.T) {
			n := defaultOrders[kind]
			if v := os.Getenv(EnvSoakOrders); v != "" {
				var err error
				n, err = strconv.Atoi(v)
				require.NoError(t, err, "%s=%q: want a number of orders", EnvSoakOrders, v)
			}
			if testing.Short() && n > 30 {
				n = 30
			}
			runReliability(t, kind, v.fake, v.driver, n)
		})
	}
}

type bundle struct {
	schema *pgtest.Schema
	tr     *transport.Transport
	app    *app.App
	faults faults
}

func setup(t *testing.T, kind transport.Kind, fake bool, driver string) *bundle {
	t.Helper()
	schema := pgtest.New(t, app.AllMigrations()...)
	schema.DB.SetMaxOpenConns(12)
	prefix := "t" + randHex(5) + "."
	var (
		cfg transport.Config
		f   faults
	)
	switch kind {
	case transport.GoChannel:
		cfg.Kind = transport.GoChannel
	case transport.SQL:
		// The transport reaches Postgres through a proxy that can cut it
		// off; the services' own pool does not.
		proxy := newFaultProxy(t, hostPort(t, schema.URL))
		c, err := transport.ParseURL(proxiedURL(t, proxy, schema.URL))
		require.NoError(t, err)
		cfg = c
		f.refuse, f.refused = proxy.Outage, proxy.Refused
		f.relayUnaffected = true
	case transport.AMQP:
		cfg.Kind = transport.AMQP
		cfg.AMQP.URL = amqpURL
		if !raceDetector { // see race_on_test.go
			proxy := newFaultProxy(t, hostPort(t, amqpURL))
			cfg.AMQP.URL = proxiedURL(t, proxy, amqpURL)
			f.refuse, f.refused = proxy.Outage, proxy.Refused
		}
		t.Cleanup(func() { deleteAMQP(t, app.NewTopics(prefix)) })
	case transport.Kafka:
		if !fake {
			cfg = transporttest.Config(t, kind)
			break
		}
		k, err := embedded.Kafka()
		require.NoError(t, err)
		t.Cleanup(func() { _ = k.Close() })
		cfg = k.Config()
		refused := new(atomic.Int64)
		f.refused = refused.Load
		f.refuse = func(d time.Duration) { refuseProduce(k, d, refused) }
	case transport.NATS:
		// The outage is made at the relay's publisher (nats.go buffers
		// what is published while it reconnects, so a cut connection is
		// not a refusal the relay would see).
		cfg = transporttest.Config(t, kind)
		t.Cleanup(func() { transporttest.DeleteNATSStreams(t, app.NewTopics(prefix).All()) })
	case transport.GoogleCloud:
		if !fake {
			cfg = transporttest.Config(t, kind)
			break
		}
		r := &unavailablePublish{}
		p := &embedded.PubSubServer{Server: pstest.NewServer(pstest.ServerReactorOption{FuncName: "Publish", Reactor: r}), ProjectID: "millwright-test"}
		t.Cleanup(func() { _ = p.Close() })
		cfg = p.Config()
		// The client retries UNAVAILABLE within one Publish until its
		// timeout: keep that below the outage so the relay sees failures.
		cfg.GoogleCloud.PublishTimeout = 500 * time.Millisecond
		f.refuse, f.refused = r.outage, r.refused.Load
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err, "opening %s (is the broker running?)", kind)
	acfg := app.Config{
		DB: schema.DB, DatabaseURL: schema.URL, Transport: tr, TopicPrefix: prefix,
		Duplicate:     true,
		ConsumerRetry: retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 500 * time.Millisecond, MaxAttempts: 20},
		RelayLease:    relayLease(kind),
		RelayRetry:    retry.Policy{InitialInterval: 50 * time.Millisecond, MaxInterval: 500 * time.Millisecond, MaxAttempts: 1000},
		StepTimeout:   2 * time.Minute, SagaPollInterval: 200 * time.Millisecond,
	}
	if driver == pgtest.DriverPgx {
		acfg.DB, acfg.Pgx = nil, schema.Pgx(t)
	}
	a, err := app.New(acfg)
	require.NoError(t, err)
	// Transport closed after the services (registered first, runs last).
	t.Cleanup(func() { _ = tr.Close() })
	require.NoError(t, a.Seed(ctx, map[string]int64{"book": 1_000_000, "lamp": 1_000_000}))
	return &bundle{schema: schema, tr: tr, app: a, faults: f}
}

// relayLease is the relays' lease: short, so that the lanes of the relay
// the test kills come free soon, but above the slowest healthy publish
// (relay.Config.Lease's rule). Pub/Sub's publishes (the emulator, a JVM
// sharing two cores with the whole suite, and pstest under -race) took
// over the 0.4 s a 1 s lease leaves a batch's publish in loaded CI runs:
// a third to all of the batches were cut, and the orders settled slowly
// or not at all.
func relayLease(kind transport.Kind) time.Duration {
	if kind == transport.GoogleCloud {
		return 5 * time.Second
	}
	return time.Second
}

func runReliability(t *testing.T, kind transport.Kind, fake bool, driver string, n int) {
	b := setup(t, kind, fake, driver)
	ctx := context.Background()

	// Every service but the relay, which the test runs itself.
	startServices(t, ctx, b.app, app.DeadLetters, app.Inventory, app.Billing, app.Shipping, app.Notify, app.Orchestrator, app.Orders)

	// Orders, every 5th declined by billing, every 9th refused by shipping.
	want := placeOrders(t, b.app, n)

	// The poison message: a command billing cannot decode.
	poisonID := "poison-" + randHex(4)
	poison := message.NewMessage(poisonID, []byte("{not json"))
	poison.Metadata.Set(metadata.EventID, poisonID)
	poison.Metadata.Set(metadata.SagaID, poisonID)
	poison.Metadata.Set(metadata.SagaPhase, "forward")
	require.NoError(t, b.tr.Publisher().Publish(b.app.Topics().BillingCommands, poison))

	// Relay 1 dies in the middle of its first batch (all n order.created
	// rows are pending when it starts).
	killCtx, kill := context.WithCancel(ctx)
	dying := &killingPublisher{Publisher: b.tr.Publisher(), after: int64(max(n/3, 1)), kill: kill}
	r1, err := b.app.NewRelay(dying)
	require.NoError(t, err)
	r1Done := make(chan error, 1)
	go func() { r1Done <- r1.Run(killCtx) }()
	select {
	case <-r1Done:
	case <-time.After(time.Minute):
		t.Fatal("relay 1 was not killed within a minute: it published fewer messages than planned")
	}
	require.GreaterOrEqual(t, dying.published.Load(), dying.after)

	// Relay 2 takes over; the broker refuses publishes for a while.
	pub := b.tr.Publisher()
	window := 3 * time.Second
	flaky := &refusingPublisher{Publisher: pub}
	if b.faults.refuse != nil {
		b.faults.refuse(window)
	} else {
		flaky.refuseFor(window)
		pub = flaky
	}
	r2, err := b.app.NewRelay(pub)
	require.NoError(t, err)
	relayCtx, stopRelay := context.WithCancel(ctx)
	r2Done := make(chan error, 1)
	go func() { r2Done <- r2.Run(relayCtx) }()
	t.Cleanup(func() {
		stopRelay()
		require.NoError(t, <-r2Done)
	})

	s, err := waitSettledWhileProgressing(ctx, b.app, n)
	if err != nil {
		logWhereItStopped(t, b.schema.DB)
		t.Logf("relay 2 stats: %+v", r2.Stats())
	}
	require.NoError(t, err, "summary: %s", s)
	refused := flaky.refused.Load()
	if b.faults.refused != nil {
		refused = b.faults.refused()
	}
	t.Logf("%s: %s (relay 1 killed after %d publishes; outage refused %d requests or connections)", kind, s, dying.after, refused)
	require.Positive(t, refused, "the broker outage was not exercised")
	if !b.faults.relayUnaffected {
		// The relay itself met the outage: rows it failed to publish were
		// put back with a retry (relay 1 was killed by cancellation, so
		// its rows carry none); or, when the broker held its answers past
		// the lanes' lease, the batch was cut and its rows left pending.
		retried := count(t, b.schema.DB, `SELECT count(*) FROM millwright_outbox WHERE retry_count > 0`)
		require.True(t, retried > 0 || r2.Stats().Cut > 0,
			"no outbox row was retried and no batch cut: relay 2 never met the outage (%+v)", r2.Stats())
	}

	db := b.schema.DB
	require.Equal(t, n, s.Orders)
	require.Zero(t, s.Pending, "lost orders")
	require.Equal(t, want.completed, s.Completed, "completed orders")
	require.Equal(t, n-want.completed, s.Compensated, "compensated orders")
	require.Zero(t, s.DuplicateEffects, "effects applied twice: %v", duplicateEffects(t, db))
	require.Zero(t, s.BrokenCompensations, "settled orders whose participants contradict the outcome")
	require.Zero(t, s.UnnotifiedEvents)
	require.Equal(t, 2*n, s.Notifications, "one notification per order event")

	// Inventory balances: what left the stock is exactly what completed
	// orders hold; cancelled orders hold nothing.
	require.Zero(t, count(t, db, `SELECT count(*) FROM orders_stock st WHERE st.initial - st.available <>
		(SELECT COALESCE(sum(r.qty), 0) FROM orders_reservations r WHERE r.sku = st.sku AND r.status = 'reserved')`), "stock out of balance")
	require.Zero(t, count(t, db, `SELECT count(*) FROM orders_orders o FULL JOIN
		(SELECT * FROM orders_reservations WHERE status = 'reserved') r ON r.order_id = o.id
		WHERE (o.status = 'completed') IS DISTINCT FROM (r.order_id IS NOT NULL) OR r.qty <> o.qty`), "reservations do not match completed orders")
	// Payments balance: charged exactly the completed orders' amounts;
	// every charge of a cancelled order was refunded.
	require.Zero(t, count(t, db, `SELECT count(*) FROM orders_orders o FULL JOIN
		(SELECT * FROM orders_payments WHERE status = 'charged') p ON p.order_id = o.id
		WHERE (o.status = 'completed') IS DISTINCT FROM (p.order_id IS NOT NULL) OR p.amount_cents <> o.amount_cents`), "payments do not match completed orders")
	require.Equal(t, want.refunded, count(t, db, `SELECT count(*) FROM orders_payments WHERE status = 'refunded' AND amount_cents > 0`), "refunds")
	require.Equal(t, want.completed, count(t, db, `SELECT count(*) FROM orders_shipments WHERE status = 'scheduled'`), "shipments")
	// Every saga finished; every outbox row was published.
	require.Equal(t, n, count(t, db, `SELECT count(*) FROM millwright_saga_instances WHERE state IN ('completed', 'compensated')`))
	require.Zero(t, count(t, db, `SELECT count(*) FROM millwright_outbox WHERE status <> 'published'`), "outbox rows not published")
	// The dead-letter queue holds exactly the poison message.
	dead, err := dlq.NewStore(postgres.From(db)).List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.NotEmpty(t, dead)
	for _, d := range dead {
		require.Equal(t, poisonID, d.MessageUUID, "unexpected dead letter: %+v", d)
		require.Equal(t, b.app.Topics().BillingCommands, d.OriginalTopic)
	}
}

// settleQuiet is how long the orders may go without any progress (an
// order settling, a notification, a dead letter) before the wait gives
// up; settleCeiling bounds the whole wait. The wait is bounded by
// progress, not by a budget per order: on a loaded machine (the whole CI
// run beside it) the real Pub/Sub emulator streamed 50 orders' messages
// slower than the fixed 80 s it had, and the run failed while the orders
// were still settling.
const (
	settleQuiet   = time.Minute
	settleCeiling = 5 * time.Minute
)

// waitSettledWhileProgressing waits for the n orders to settle as long as
// they make progress: it fails after settleQuiet without a change in the
// summary, or after settleCeiling.
func waitSettledWhileProgressing(ctx context.Context, a *app.App, n int) (app.Summary, error) {
	ceiling := time.Now().Add(settleCeiling)
	var last app.Summary
	for {
		wctx, cancel := context.WithTimeout(ctx, settleQuiet)
		s, err := a.WaitSettled(wctx, "%", 1)
		cancel()
		if err == nil || !errors.Is(err, context.DeadlineExceeded) {
			return s, err
		}
		switch {
		case s == last:
			return s, fmt.Errorf("no progress in %s (%d orders): %w", settleQuiet, n, err)
		case time.Now().After(ceiling):
			return s, fmt.Errorf("still settling after %s (%d orders): %w", settleCeiling, n, err)
		}
		last = s
	}
}

type expectation struct{ completed, refunded int }

func placeOrders(t *testing.T, a *app.App, n int) expectation {
	var (
		want expectation
		wg   sync.WaitGroup
		errs = make(chan error, n)
		sem  = make(chan struct{}, 8)
	)
	for i := 1; i <= n; i++ {
		o := app.Order{ID: fmt.Sprintf("o-%05d", i), SKU: []string{"book", "lamp"}[i%2], Qty: 1 + i%3, AmountCents: int64(1000 + 37*i)}
		switch {
		case i%5 == 0:
			o.FailPayment = true
		case i%9 == 0:
			o.FailShipping = true
			want.refunded++
		default:
			want.completed++
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			_, err := a.PlaceOrder(context.Background(), o)
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	return want
}

// killingPublisher publishes `after` messages, then kills its relay (cancels
// its context) and fails every later publish, so the relay dies between
// publishing part of a batch and marking it.
type killingPublisher struct {
	message.Publisher
	after     int64
	kill      context.CancelFunc
	published atomic.Int64
}

var errKilled = errors.New("relay killed by the test")

func (p *killingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if p.published.Load() >= p.after {
			p.kill()
			return errKilled
		}
		if err := p.Publisher.Publish(topic, m); err != nil {
			return err
		}
		if p.published.Add(1) >= p.after {
			p.kill()
		}
	}
	return nil
}

// refusingPublisher fails every publish until a deadline, like a broker
// that refuses connections.
type refusingPublisher struct {
	message.Publisher
	until   atomic.Int64
	refused atomic.Int64
}

func (p *refusingPublisher) refuseFor(d time.Duration) { p.until.Store(time.Now().Add(d).UnixNano()) }

func (p *refusingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if time.Now().UnixNano() < p.until.Load() {
		p.refused.Add(1)
		return errors.New("broker unavailable (injected by the test)")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// refuseProduce makes the kfake cluster answer every Produce request with
// NOT_ENOUGH_REPLICAS for d.
func refuseProduce(k *embedded.KafkaCluster, d time.Duration, refused *atomic.Int64) {
	until := time.Now().Add(d)
	k.Cluster.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if time.Now().After(until) {
			k.Cluster.DropControl()
			return nil, nil, false
		}
		k.Cluster.KeepControl()
		refused.Add(1)
		preq := req.(*kmsg.ProduceRequest)
		resp := preq.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range preq.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic = rt.Topic
			st.TopicID = rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.NotEnoughReplicas.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
}

func count(t *testing.T, db *sql.DB, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(q, args...).Scan(&n), q)
	return n
}

func duplicateEffects(t *testing.T, db *sql.DB) []string {
	t.Helper()
	return pgtest.Column[string](t, db, `SELECT service || ' ' || order_id || ' ' || action || ' x' || count(*) FROM orders_effects
		GROUP BY service, order_id, action HAVING count(*) > 1 LIMIT 20`)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// deleteAMQP removes the test's exchanges and queues from the shared
// RabbitMQ server.
func deleteAMQP(t *testing.T, topics app.Topics) {
	var all []string
	for _, topic := range topics.All() {
		all = append(all, topic, dlq.DefaultTopic(topic))
	}
	if err := tramqp.DeleteTopology(amqpURL, all, app.Groups...); err != nil {
		t.Logf("cleanup: %v", err)
	}
}

// hostPort is the host:port of a URL, for a proxy in front of it.
func hostPort(t *testing.T, rawURL string) string {
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	return u.Host
}

// logWhereItStopped logs, for a run that did not settle, where its work
// stands: the outbox by topic and status (and the pending rows' last
// errors), the sagas by state and step, their step records, and the
// effects applied.
func logWhereItStopped(t *testing.T, db *sql.DB) {
	t.Helper()
	for _, q := range []string{
		`SELECT 'outbox '||topic||' '||status||' '||count(*)||', retried '||count(*) FILTER (WHERE retry_count > 0) FROM millwright_outbox GROUP BY topic, status`,
		`SELECT 'outbox pending, last error '||left(coalesce(last_error, 'none'), 400)||': '||count(*) FROM millwright_outbox WHERE status = 'pending' GROUP BY left(coalesce(last_error, 'none'), 400)`,
		`SELECT 'saga '||state||' at step '||current_step||': '||count(*) FROM millwright_saga_instances GROUP BY state, current_step`,
		`SELECT 'saga step '||step||' '||kind||': '||count(*) FROM millwright_saga_steps GROUP BY step, kind`,
		`SELECT 'effect '||service||' '||action||': '||count(*) FROM orders_effects GROUP BY service, action`,
	} {
		rows, err := db.Query(q)
		if err != nil {
			t.Logf("%s: %v", q, err)
			continue
		}
		for rows.Next() {
			var l string
			if rows.Scan(&l) == nil {
				t.Log(l)
			}
		}
		_ = rows.Close()
	}
}
