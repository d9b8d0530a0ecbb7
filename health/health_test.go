package health_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

var (
	_ health.LastSuccesser     = (*relay.Relay)(nil)
	_ health.RouterState       = (*message.Router)(nil)
	_ health.OrchestratorState = (*saga.Orchestrator[struct{}])(nil)
)

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, err := io.ReadAll(rec.Result().Body)
	require.NoError(t, err)
	return rec.Code, string(body)
}

func TestReadinessListsEveryCheckAndFailsOnOne(t *testing.T) {
	t.Parallel()
	h, err := health.NewHandler(health.Config{})
	require.NoError(t, err)
	var dbErr atomic.Pointer[error]
	h.Add("database", health.CheckerFunc(func(context.Context) error {
		if p := dbErr.Load(); p != nil {
			return *p
		}
		return nil
	}))
	h.Add("broker", health.CheckerFunc(func(context.Context) error { return nil }))

	code, body := get(t, h, health.PathReady)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "[+]broker ok\n[+]database ok\nreadyz check passed\n", body)

	refused := errors.New("connection refused\nretry")
	dbErr.Store(&refused)
	code, body = get(t, h, health.PathReady)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "[+]broker ok\n[-]database failed: connection refused; retry\nreadyz check failed\n", body)
	rep := h.Check(context.Background())
	require.False(t, rep.Ready)
	require.ErrorContains(t, rep.Err(), "database: connection refused")

	// Liveness does not depend on the checks.
	code, body = get(t, h, health.PathLive)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok\n", body)
	code, _ = get(t, h, "/other")
	require.Equal(t, http.StatusNotFound, code)
}

func TestDrainFailsReadinessOnly(t *testing.T) {
	t.Parallel()
	h, err := health.NewHandler(health.Config{})
	require.NoError(t, err)
	code, _ := get(t, h, health.PathReady)
	require.Equal(t, http.StatusOK, code)
	h.Drain()
	code, body := get(t, h, health.PathReady)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "[-]draining")
	require.ErrorIs(t, h.Check(context.Background()).Err(), health.ErrDraining)
	code, _ = get(t, h, health.PathLive)
	require.Equal(t, http.StatusOK, code)
}

// A check that hangs (and ignores its ctx) fails after CheckTimeout
// instead of hanging the probe.
func TestHangingCheckTimesOut(t *testing.T) {
	t.Parallel()
	h, err := health.NewHandler(health.Config{CheckTimeout: 50 * time.Millisecond})
	require.NoError(t, err)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	h.Add("stuck", health.CheckerFunc(func(context.Context) error { <-release; return nil }))
	h.Add("panics", health.CheckerFunc(func(context.Context) error { panic("boom") }))
	start := time.Now()
	rep := h.Check(context.Background())
	require.Less(t, time.Since(start), 5*time.Second)
	require.False(t, rep.Ready)
	require.ErrorContains(t, rep.Err(), "stuck: did not answer within 50ms")
	require.ErrorContains(t, rep.Err(), "panics: check panicked: boom")
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := health.NewHandler(health.Config{CheckTimeout: -time.Second})
	require.ErrorContains(t, err, "health: Config.CheckTimeout -1s: want at least 1ms")
}

type fakeRelay struct {
	running chan struct{}
	last    atomic.Int64
}

func (f *fakeRelay) Running() <-chan struct{} { return f.running }
func (f *fakeRelay) LastSuccess() time.Time {
	if n := f.last.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

func TestRelayCheck(t *testing.T) {
	t.Parallel()
	r := &fakeRelay{running: make(chan struct{})}
	c := health.Relay(r, time.Minute)
	ctx := context.Background()
	require.ErrorContains(t, c.Check(ctx), "not running")
	close(r.running)
	require.ErrorContains(t, c.Check(ctx), "no successful round yet")
	r.last.Store(time.Now().UnixNano())
	require.NoError(t, c.Check(ctx))
	r.last.Store(time.Now().Add(-2 * time.Minute).UnixNano())
	require.ErrorContains(t, c.Check(ctx), "last successful round 2m")
	require.ErrorContains(t, c.Check(ctx), "(limit 1m0s)")
	require.ErrorContains(t, health.Relay(nil, 0).Check(ctx), "no relay")
}

// The Router check follows a real Watermill router through its life.
func TestRouterCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	r.AddConsumerHandler("h", "topic", ps, func(*message.Message) error { return nil })
	c := health.Router(r)
	require.ErrorContains(t, c.Check(ctx), "not running")
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("router did not start within 10s")
	}
	require.NoError(t, c.Check(ctx))
	require.NoError(t, r.Close())
	require.NoError(t, <-done)
	require.ErrorContains(t, c.Check(ctx), "closed")
}

type fakeOrch struct {
	running chan struct{}
	stopped atomic.Bool
}

func (f *fakeOrch) Running() <-chan struct{} { return f.running }
func (f *fakeOrch) Stopped() bool            { return f.stopped.Load() }

func TestOrchestratorCheck(t *testing.T) {
	t.Parallel()
	o := &fakeOrch{running: make(chan struct{})}
	c := health.Orchestrator(o)
	ctx := context.Background()
	require.ErrorContains(t, c.Check(ctx), "not running")
	close(o.running)
	require.NoError(t, c.Check(ctx))
	o.stopped.Store(true)
	require.ErrorContains(t, c.Check(ctx), "stopped")
}

type pinger struct{ err error }

func (p pinger) PingContext(context.Context) error { return p.err }

func TestPingCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	require.NoError(t, health.Ping(pinger{}).Check(ctx))
	require.ErrorContains(t, health.Ping(pinger{errors.New("dial tcp: refused")}).Check(ctx), "refused")
	require.True(t, strings.Contains(health.Ping(nil).Check(ctx).Error(), "no database"))
}

// The database check of a service on either driver is one call.
func TestPingCheckOfADatabaseOnEitherDriver(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		s := pgtest.New(t)
		require.NoError(t, health.Ping(s.Handles(t, driver)).Check(context.Background()))
	})
	require.ErrorIs(t, health.Ping(postgres.DB{}).Check(context.Background()), postgres.ErrNoDB)
}

// A flood of readiness requests runs each check once at a time: requests
// that arrive while the checks run share their results. Before, every
// request ran every check (a database check took one connection of the
// pool per request).
func TestFloodSharesOneEvaluation(t *testing.T) {
	t.Parallel()
	h, err := health.NewHandler(health.Config{CheckTimeout: time.Minute})
	require.NoError(t, err)
	var running, most, calls, arrived atomic.Int64
	release := make(chan struct{})
	h.Add("database", health.CheckerFunc(func(context.Context) error {
		calls.Add(1)
		n := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		<-release
		return nil
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	const flood = 50
	codes := make(chan int, flood)
	for range flood {
		go func() {
			c := http.Client{Timeout: time.Minute}
			resp, err := c.Get(srv.URL + health.PathReady)
			if err != nil {
				codes <- 0
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
	}
	deadline := time.Now().Add(20 * time.Second)
	for arrived.Load() < flood || running.Load() == 0 {
		if time.Now().After(deadline) {
			close(release)
			t.Fatalf("after 20s, %d of %d requests arrived, %d check(s) running", arrived.Load(), flood, running.Load())
		}
		time.Sleep(5 * time.Millisecond) // polling for arrivals, bounded
	}
	close(release)
	for range flood {
		select {
		case c := <-codes:
			require.Equal(t, http.StatusOK, c)
		case <-time.After(30 * time.Second):
			t.Fatal("a readiness request did not answer within 30s of the release")
		}
	}
	require.Equal(t, int64(1), most.Load(), "checks running at once during the flood of %d (calls: %d)", flood, calls.Load())
	require.Equal(t, int64(1), calls.Load(), "the %d requests that arrived while the check ran shared its result", flood)
}

// With CacheFor, a request within it of the last evaluation runs no check;
// Drain shows at once anyway, and a check added later runs at the next
// request.
func TestCacheFor(t *testing.T) {
	t.Parallel()
	h, err := health.NewHandler(health.Config{CacheFor: time.Hour})
	require.NoError(t, err)
	var calls atomic.Int64
	h.Add("database", health.CheckerFunc(func(context.Context) error { calls.Add(1); return nil }))
	for range 3 {
		code, _ := get(t, h, health.PathReady)
		require.Equal(t, http.StatusOK, code)
	}
	require.Equal(t, int64(1), calls.Load(), "one evaluation answered the three requests")
	h.Add("broker", health.CheckerFunc(func(context.Context) error { return errors.New("down") }))
	code, body := get(t, h, health.PathReady)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "[-]broker failed: down")
	require.Equal(t, int64(2), calls.Load())
	h.Drain()
	code, body = get(t, h, health.PathReady)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "[-]"+health.ErrDraining.Error())
	require.Equal(t, int64(2), calls.Load(), "draining needs no evaluation")

	_, err = health.NewHandler(health.Config{CacheFor: -time.Second})
	require.ErrorContains(t, err, "Config.CacheFor -1s")
}

// A check added while an evaluation runs is in the next request's answer:
// the run that began before the Add is neither joined nor kept (before,
// it became the last evaluation when it ended and was served, cached,
// without the new check: millwright relay's /readyz then passed without
// its relays' checks, which are added while the first probes run).
func TestAddDuringAnEvaluation(t *testing.T) {
	t.Parallel()
	h, err := health.NewHandler(health.Config{CacheFor: time.Hour})
	require.NoError(t, err)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h.Add("database", health.CheckerFunc(func(context.Context) error {
		once.Do(func() { close(entered); <-release })
		return nil
	}))
	first := make(chan health.Report, 1)
	go func() { first <- h.Check(context.Background()) }()
	select {
	case <-entered: // the first evaluation runs, with the database check only
	case <-time.After(30 * time.Second):
		t.Fatal("the first evaluation did not start")
	}
	h.Add("relay-0", health.CheckerFunc(func(context.Context) error { return errors.New("not running yet") }))
	second := make(chan health.Report, 1)
	go func() { second <- h.Check(context.Background()) }()
	close(release)
	var reps []health.Report
	for _, c := range []chan health.Report{first, second} {
		select {
		case rep := <-c:
			reps = append(reps, rep)
		case <-time.After(30 * time.Second):
			t.Fatal("a Check did not return")
		}
	}
	require.True(t, reps[0].Ready, "the request that began before the Add: %s", reps[0])
	for _, rep := range []health.Report{reps[1], h.Check(context.Background())} {
		require.False(t, rep.Ready, "served the evaluation begun before the Add: %s", rep)
		require.Contains(t, rep.String(), "[-]relay-0 failed: not running yet")
	}
}
