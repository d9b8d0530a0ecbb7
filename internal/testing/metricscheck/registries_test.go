package metricscheck_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/metricscheck"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox/capture"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/gochannel"
	_ "github.com/millwright/millwright/transport/googlecloud"
	"github.com/millwright/millwright/transport/lag"
	sqltransport "github.com/millwright/millwright/transport/sql"
	"github.com/millwright/millwright/transport/transporttest"
)

// fixedLag is a lag.Reader of fixed rows.
type fixedLag []lag.Partition

func (f fixedLag) Lag(context.Context) ([]lag.Partition, error) { return f, nil }

// recorder is a fresh registry that remembers the collectors it accepted,
// so that the test can give every labelled vector a child: a vector with
// none is not gathered, and its name would escape the lint.
type recorder struct {
	*prometheus.Registry
	collectors []prometheus.Collector
}

func newRecorder() *recorder { return &recorder{Registry: prometheus.NewRegistry()} }

func (r *recorder) Register(c prometheus.Collector) error {
	err := r.Registry.Register(c)
	if err == nil {
		r.collectors = append(r.collectors, c)
	}
	return err
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// touchVectors creates one child, with placeholder label values, in every
// vector registered, trying label counts until the vector accepts one.
func (r *recorder) touchVectors(t *testing.T) {
	t.Helper()
	for _, c := range r.collectors {
		var get func(...string) error
		switch v := c.(type) {
		case *prometheus.CounterVec:
			get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
		case *prometheus.GaugeVec:
			get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
		case *prometheus.HistogramVec:
			get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
		case *prometheus.SummaryVec:
			get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
		default:
			continue
		}
		ok := false
		for n := 0; n <= 8 && !ok; n++ {
			ok = get(make([]string, n)...) == nil
		}
		require.True(t, ok, "vector %T takes more than 8 labels", c)
	}
}

// registries builds every component of millwright that registers metrics,
// each on a fresh registry, and the orders example's whole app on another.
func registries(t *testing.T) map[string]*recorder {
	t.Helper()
	ctx := context.Background()
	schema := pgtest.New(t, app.AllMigrations()...)
	tr, err := transport.Open(ctx, transport.Config{Kind: transport.GoChannel})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	regs := map[string]*recorder{}
	reg := func(name string) *recorder { r := newRecorder(); regs[name] = r; return r }

	_, err = relay.New(postgres.From(schema.DB), tr.Publisher(), relay.Config{Registerer: reg("outbox relay")})
	require.NoError(t, err)

	_, err = capture.NewTracker(postgres.From(schema.DB), capture.Config{Slot: "lint", Registerer: reg("outbox capture")})
	require.NoError(t, err)

	_, err = idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{Consumer: "lint", Registerer: reg("idempotency")})
	require.NoError(t, err)

	_, err = retry.NewMiddleware(retry.Config{Registerer: reg("retry")})
	require.NoError(t, err)

	r := reg("dlq")
	_, err = dlq.NewMiddleware(tr.Publisher(), dlq.Config{Registerer: r})
	require.NoError(t, err)
	store := dlq.NewStore(postgres.From(schema.DB))
	r.MustRegister(dlq.NewDepthCollector(store))
	// The depth gauge has a sample per topic with stored dead letters.
	dead := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	dead.Metadata.Set(metadata.DeadLetterTopic, "lint.dlq")
	_, err = store.Insert(ctx, dead)
	require.NoError(t, err)

	r = reg("park")
	_, err = park.New(postgres.From(schema.DB), park.Config{Registerer: r})
	require.NoError(t, err)
	r.MustRegister(park.NewCollector(park.NewStore(postgres.From(schema.DB))))
	// The gauges have samples per handler with parked keys.
	_, err = schema.DB.Exec(`INSERT INTO millwright_parked_keys (handler, key, due_at) VALUES ('lint', 'k', now())`)
	require.NoError(t, err)

	def, err := saga.Define[struct{}]("lint", saga.Step[struct{}]{
		Name:           "only",
		Command:        func(struct{}) (saga.Command, error) { return saga.Command{Topic: "lint.only"}, nil },
		NoCompensation: true,
	})
	require.NoError(t, err)
	_, err = saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{Registerer: reg("saga")})
	require.NoError(t, err)

	sqlTr, err := sqltransport.Open(ctx, sqltransport.Config{DB: schema.DB, Registerer: reg("transport/sql")}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlTr.Close() })

	// The emulator in CI, else pstest (transporttest says which).
	gcCfg := transporttest.Config(t, transport.GoogleCloud)
	gcCfg.GoogleCloud.Registerer = reg("transport/googlecloud")
	gcTr, err := transport.Open(ctx, gcCfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = gcTr.Close() })

	// NATS: a group subscribed to a topic with a message has every series
	// (the transport reads them when the group is watched).
	natsCfg := transporttest.Config(t, transport.NATS)
	natsCfg.NATS.Registerer = reg("transport/nats")
	natsTr, err := transport.Open(ctx, natsCfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = natsTr.Close() })
	natsTopic := "lint_nats_" + strings.ReplaceAll(schema.Name, ".", "_")
	require.NoError(t, natsTr.Publisher().Publish(natsTopic, message.NewMessage(watermill.NewUUID(), []byte("{}"))))
	natsSub, err := natsTr.Subscriber("lint")
	require.NoError(t, err)
	require.NoError(t, natsSub.(message.SubscribeInitializer).SubscribeInitialize(natsTopic))

	// Consumer lag, from a reader of fixed rows: every series it exports.
	reg("transport/lag").MustRegister(lag.NewCollector(fixedLag{{Transport: "kafka", Group: "g", Topic: "t", Partition: 0,
		Committed: 1, End: 2, Lag: 1, Unacked: 0, Keyed: true, KeysInFlight: 1, Waiting: 0}}, lag.CollectorConfig{}))

	// The example registers the relay, consumers' middlewares and saga
	// as it starts them.
	r = reg("examples/orders")
	a, err := app.New(app.Config{DB: schema.DB, Transport: tr, Registerer: r})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	proc, err := a.Start(runCtx)
	require.NoError(t, err)
	select {
	case <-proc.Running():
	case <-proc.Done():
		t.Fatalf("orders example stopped while starting: %v", proc.Wait())
	case <-time.After(time.Minute):
		t.Fatal("orders example not running after a minute")
	}
	require.NoError(t, proc.Stop())

	for _, r := range regs {
		r.touchVectors(t)
	}
	return regs
}

// Every metric family every registry of millwright shows passes promlint
// (what `promtool check metrics` runs) and millwright's rules (one
// millwright_ prefix, no OpenMetrics family clash), and every Metric*
// constant is among them, so no registry escapes the lint.
func TestEveryRegistryPassesLint(t *testing.T) {
	t.Parallel()
	regs := registries(t)
	seen := map[string]string{}
	for name, r := range regs {
		mfs, err := r.Gather()
		require.NoError(t, err, "gathering the %s registry", name)
		require.NotEmpty(t, mfs, "the %s registry shows no metric", name)
		problems, err := metricscheck.Lint(mfs)
		require.NoError(t, err, "linting the %s registry", name)
		for _, p := range problems {
			t.Errorf("%s registry: %s: %s", name, p.Metric, p.Text)
		}
		for _, mf := range mfs {
			seen[mf.GetName()] = name
		}
	}
	for metric, src := range exported(t) {
		require.Contains(t, seen, metric, "%s.%s (%s) is in no registry this test gathers: add its component to registries()", src.Package, src.Const, metric)
	}
}

// Lint refuses the names it is there to refuse.
func TestLintRules(t *testing.T) {
	t.Parallel()
	r := prometheus.NewRegistry()
	r.MustRegister(
		prometheus.NewGauge(prometheus.GaugeOpts{Name: "outbox_oldest_pending_age_seconds", Help: "h"}),
		prometheus.NewGauge(prometheus.GaugeOpts{Name: "millwright_saga_stuck", Help: "h"}),
		prometheus.NewCounter(prometheus.CounterOpts{Name: "millwright_saga_stuck_total", Help: "h"}),
		prometheus.NewGauge(prometheus.GaugeOpts{Name: "millwright_outbox_pending_count", Help: "h"}),
		prometheus.NewGauge(prometheus.GaugeOpts{Name: "millwright_relay_publish_latency_seconds", Help: "h"}),
	)
	mfs, err := r.Gather()
	require.NoError(t, err)
	problems, err := metricscheck.Lint(mfs)
	require.NoError(t, err)
	got := map[string]bool{}
	for _, p := range problems {
		got[p.Metric] = true
	}
	require.Equal(t, map[string]bool{
		"outbox_oldest_pending_age_seconds": true, // no prefix
		"millwright_saga_stuck":             true, // clashes with the counter's family
		"millwright_outbox_pending_count":   true, // _count is a histogram's
	}, got, "%v", problems)
}

// promtool check metrics, run on a registry's exposition, agrees. It needs
// Debian's prometheus package (or promtool on PATH); it skips without it,
// except under CI (MILLWRIGHT_TEST_REQUIRE_PROMTOOL=1), where it must run.
func TestPromtoolCheckMetrics(t *testing.T) {
	t.Parallel()
	promtool := requirePromtool(t)
	regs := registries(t)
	names := make([]string, 0, len(regs))
	for n := range regs {
		names = append(names, n)
	}
	sort.Strings(names)
	check := func(g prometheus.Gatherer) ([]byte, error) {
		// What a scraper reads: the text format promhttp serves.
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
		req.Header.Set("Accept", "text/plain; version=0.0.4")
		promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}).ServeHTTP(rec, req)
		require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
		cmd := exec.Command(promtool, "check", "metrics")
		cmd.Stdin = rec.Body
		return cmd.CombinedOutput()
	}
	// Control: promtool reads what it is given and refuses a bad name.
	bad := prometheus.NewRegistry()
	bad.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "millwright_outbox_pending_count", Help: "h"}))
	out, err := check(bad)
	require.Error(t, err, "promtool check metrics accepted a gauge named _count:\n%s", out)
	require.Contains(t, string(out), "millwright_outbox_pending_count")
	for _, name := range names {
		out, err := check(regs[name])
		require.NoError(t, err, "promtool check metrics on the %s registry:\n%s", name, out)
	}
}

// promtool check rules accepts the shipped alert rules.
func TestPromtoolCheckRules(t *testing.T) {
	t.Parallel()
	promtool := requirePromtool(t)
	out, err := exec.Command(promtool, "check", "rules", root+"/deploy/prometheus/alerts.yml").CombinedOutput()
	require.NoError(t, err, "promtool check rules deploy/prometheus/alerts.yml:\n%s", out)
	var rf rulesFile
	raw, err := os.ReadFile(root + "/deploy/prometheus/alerts.yml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(raw, &rf))
	n := 0
	for _, g := range rf.Groups {
		n += len(g.Rules)
	}
	require.Contains(t, string(out), fmt.Sprintf("SUCCESS: %d rules found", n), "promtool read every rule")
}

// EnvRequirePromtool, set to 1 (as CI does), makes the promtool tests fail
// instead of skipping when promtool is not installed.
const EnvRequirePromtool = "MILLWRIGHT_TEST_REQUIRE_PROMTOOL"

func requirePromtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err == nil {
		return p
	}
	if strings.TrimSpace(os.Getenv(EnvRequirePromtool)) == "1" {
		t.Fatalf("promtool not found on PATH and %s=1: install it (apt-get install prometheus, or a release from prometheus.io)", EnvRequirePromtool)
	}
	t.Skipf("promtool not found on PATH (apt-get install prometheus); set %s=1 to make this a failure", EnvRequirePromtool)
	return ""
}
