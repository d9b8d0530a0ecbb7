package app_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
)

// setupHTTP runs every service (relay included) on the in-process
// transport and serves the order API, the services on driver (pgx or pq).
func setupHTTP(t *testing.T, driver string) (*app.App, *transport.Transport, *httptest.Server) {
	t.Helper()
	schema := pgtest.New(t, app.AllMigrations()...)
	schema.DB.SetMaxOpenConns(8)
	ctx := context.Background()
	tr, err := transport.Open(ctx, transport.Config{Kind: transport.GoChannel})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	cfg := app.Config{DB: schema.DB, DatabaseURL: schema.URL, Transport: tr, SagaPollInterval: 100 * time.Millisecond}
	if driver == pgtest.DriverPgx {
		cfg.DB, cfg.Pgx = nil, schema.Pgx(t)
	}
	a, err := app.New(cfg)
	require.NoError(t, err)
	require.NoError(t, a.Seed(ctx, map[string]int64{"book": 10}))
	startServices(t, ctx, a)
	srv := httptest.NewServer(a.Handler())
	t.Cleanup(srv.Close)
	return a, tr, srv
}

// The whole workflow, through the HTTP API, on each driver.
func TestHTTPOrderLifecycle(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testHTTPOrderLifecycle(t, driver)
	})
}

func testHTTPOrderLifecycle(t *testing.T, driver string) {
	a, tr, srv := setupHTTP(t, driver)

	// Invalid requests are refused with the reason.
	for body, want := range map[string]string{
		`{"sku":"book","qty":0,"amount_cents":100}`: "qty 0",
		`{"sku":"","qty":1,"amount_cents":100}`:     "sku is empty",
		`{"sku":"book","qty":1,"color":"red"}`:      "unknown field",
	} {
		resp, err := http.Post(srv.URL+"/orders", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusBadRequest, resp.StatusCode, body)
		require.Contains(t, string(b), want)
	}
	resp, err := http.Get(srv.URL + "/orders/nope")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode)

	// One order completes, one fails payment, one finds no stock (11 > the
	// 10 in stock); all three settle.
	place := func(body string) app.Order {
		resp, err := http.Post(srv.URL+"/orders", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		var o app.Order
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&o))
		require.Equal(t, app.StatusPending, o.Status)
		require.Equal(t, "/orders/"+o.ID, resp.Header.Get("Location"))
		return o
	}
	ok := place(`{"id":"ok-1","sku":"book","qty":3,"amount_cents":1500}`)
	declined := place(`{"id":"declined-1","sku":"book","qty":1,"amount_cents":1500,"fail_payment":true}`)
	noStock := place(`{"id":"nostock-1","sku":"book","qty":11,"amount_cents":1500}`)
	again := place(`{"id":"ok-1","sku":"lamp","qty":9,"amount_cents":1}`) // a retried POST changes nothing
	require.Equal(t, "book", again.SKU)

	// A poison command ends in the dead-letter queue.
	poison := message.NewMessage("poison-http", []byte("{"))
	poison.Metadata.Set(metadata.EventID, "poison-http")
	poison.Metadata.Set(metadata.SagaID, "poison-http")
	require.NoError(t, tr.Publisher().Publish(a.Topics().InventoryCommands, poison))

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := a.WaitSettled(ctx, "%", 1)
	require.NoError(t, err, "summary %s", s)
	require.Equal(t, "orders=3 completed=1 compensated=2 dlq=1 lost=0 duplicate_effects=0 broken_compensations=0", s.String())

	get := func(id string) app.Order {
		resp, err := http.Get(srv.URL + "/orders/" + id)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		var o app.Order
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&o))
		return o
	}
	require.Equal(t, app.StatusCompleted, get(ok.ID).Status)
	d := get(declined.ID)
	require.Equal(t, app.StatusCancelled, d.Status)
	require.Contains(t, d.Reason, "payment declined")
	ns := get(noStock.ID)
	require.Equal(t, app.StatusCancelled, ns.Status)
	require.Contains(t, ns.Reason, "out of stock")
	require.NotNil(t, ns.SettledAt)

	// /metrics exposes the metrics of every millwright component.
	require.Eventually(t, func() bool {
		resp, err := http.Get(srv.URL + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for _, name := range []string{
			relay.MetricPendingCount, relay.MetricOldestPendingAge, relay.MetricFailedCount, relay.MetricPublishLatency, relay.MetricPublished,
			idempotency.MetricProcessed, idempotency.MetricDuplicates,
			dlq.MetricDeadLetters, dlq.MetricDepth,
			saga.MetricStarted, saga.MetricCompleted, saga.MetricCompensated, saga.MetricDuration,
		} {
			if !strings.Contains(string(b), "\n"+name) {
				t.Logf("metric %s not exposed yet", name)
				return false
			}
		}
		return true
	}, 10*time.Second, 100*time.Millisecond)
}

// The app runs on one pool: Pgx or DB, not both, not neither.
func TestConfigWantsOnePool(t *testing.T) {
	t.Parallel()
	tr, err := transport.Open(context.Background(), transport.Config{Kind: transport.GoChannel})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	db, err := sql.Open("postgres", "postgres://127.0.0.1:1/none") // does not connect
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // connects lazily
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	_, err = app.New(app.Config{Transport: tr})
	require.ErrorContains(t, err, "Config.Pgx and Config.DB are nil")
	_, err = app.New(app.Config{Transport: tr, DB: db, Pgx: pool})
	require.ErrorContains(t, err, "both Config.Pgx and Config.DB are set")
	_, err = app.New(app.Config{Transport: tr, Pgx: pool})
	require.NoError(t, err)
	_, err = app.New(app.Config{Transport: tr, DB: db})
	require.NoError(t, err)
}
