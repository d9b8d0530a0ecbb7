package app_test

import (
	"context"
	"database/sql"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// TestLateShipmentIsCancelled is the outage that left shipments scheduled
// for cancelled orders: shipping is down past the ship step's timeout and
// past the first attempt of the cancellation, then comes back and works
// through its queue, scheduling the shipment first. The order ends
// cancelled with the timeout as its reason, the payment refunded, the
// stock released and the shipment cancelled, each effect applied once; the
// saga recorded the late success and sent the cancellation for it. On
// every transport kind.
func TestLateShipmentIsCancelled(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out two 5 s timeouts on every transport kind; skipped with -short")
	}
	t.Parallel()
	for _, kind := range transport.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			runLateShipment(t, kind)
		})
	}
}

func runLateShipment(t *testing.T, kind transport.Kind) {
	schema := pgtest.New(t, app.AllMigrations()...)
	schema.DB.SetMaxOpenConns(12)
	prefix := "t" + randHex(5) + "."
	cfg := transport.Config{Kind: kind}
	switch kind {
	case transport.SQL:
		cfg.SQL.DB = schema.DB
	case transport.GoChannel:
	default:
		cfg = transporttest.Config(t, kind)
	}
	// Shipping subscribes only when it is back: its queue or
	// subscription must exist before the first command is published.
	cfg.AMQP.DeclareGroups = []string{app.GroupShipping}
	cfg.GoogleCloud.DeclareGroups = []string{app.GroupShipping}
	if kind == transport.AMQP {
		t.Cleanup(func() { deleteAMQP(t, app.NewTopics(prefix)) })
	}
	ctx := context.Background()
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err, "opening %s (is the broker running?)", kind)
	t.Cleanup(func() { _ = tr.Close() }) // after the services (registered first, runs last)
	// Reserve and charge answer well within the timeout; shipping cannot.
	const timeout = 5 * time.Second
	a, err := app.New(app.Config{DB: schema.DB, DatabaseURL: schema.URL, Transport: tr, TopicPrefix: prefix,
		StepTimeout: timeout, SagaPollInterval: 100 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, a.Seed(ctx, map[string]int64{"book": 10}))

	// Every service but shipping.
	var up []app.Service
	for _, s := range app.AllServices {
		if s != app.Shipping {
			up = append(up, s)
		}
	}
	startServices(t, ctx, a, up...)

	_, err = a.PlaceOrder(ctx, app.Order{ID: "late-1", SKU: "book", Qty: 2, AmountCents: 2500})
	require.NoError(t, err)

	// The ship step times out, then the first cancellation does too; the
	// saga's reason still names the step's timeout.
	cause := `step "ship" timed out after 5s`
	poll.Until(t, time.Minute, func() bool {
		h, err := saga.History(ctx, postgres.From(schema.DB), "late-1")
		require.NoError(t, err)
		n := 0
		for _, e := range h {
			if e.Step == "ship" && e.Kind == saga.KindTimeout {
				n++
			}
		}
		return n == 2
	}, "the ship step and its first cancellation time out")
	info, _, err := saga.Get(ctx, postgres.From(schema.DB), "late-1")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(info.LastError, cause+`; then compensation of step "ship" (attempt `), info.LastError)
	require.Zero(t, count(t, schema.DB, `SELECT count(*) FROM orders_shipments`), "shipping was down")

	// Shipping is back.
	ship, err := a.Start(ctx, app.Shipping)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ship.Stop()) })

	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	s, err := a.WaitSettled(wctx, "late-%", 0)
	require.NoError(t, err, "summary %s", s)
	var h []saga.HistoryEntry
	poll.Until(t, time.Minute, func() bool {
		h, err = saga.History(ctx, postgres.From(schema.DB), "late-1")
		require.NoError(t, err)
		late := slices.IndexFunc(h, func(e saga.HistoryEntry) bool { return e.Kind == saga.KindLateSuccess })
		return late >= 0 && h[len(h)-1].Kind == saga.KindCompensated && len(h)-1 > late
	}, "the late ship.succeeded recorded and compensated; history %v", h)
	late := slices.IndexFunc(h, func(e saga.HistoryEntry) bool { return e.Kind == saga.KindLateSuccess })
	require.Equal(t, "ship", h[late].Step)
	require.Equal(t, app.ReplyScheduled, h[late].Detail)
	require.Equal(t, saga.KindCompensation, h[late+1].Kind, "the cancellation is sent with the late success")
	require.Equal(t, "ship", h[late+1].Step)
	require.Equal(t, app.CommandCancel, h[late+1].Detail)

	o, err := a.GetOrder(ctx, "late-1")
	require.NoError(t, err)
	require.Equal(t, app.StatusCancelled, o.Status)
	require.Equal(t, cause, o.Reason)
	info, _, err = saga.Get(ctx, postgres.From(schema.DB), "late-1")
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, info.State)
	require.Equal(t, cause, info.LastError)

	db := schema.DB
	require.Zero(t, s.DuplicateEffects, "effects applied twice: %v", duplicateEffects(t, db))
	require.Equal(t, "cancelled", rowStatus(t, db, `SELECT status FROM orders_shipments WHERE order_id = 'late-1'`), "the late shipment is cancelled")
	require.Equal(t, "refunded", rowStatus(t, db, `SELECT status FROM orders_payments WHERE order_id = 'late-1'`))
	require.Equal(t, "released", rowStatus(t, db, `SELECT status FROM orders_reservations WHERE order_id = 'late-1'`))
	require.Zero(t, count(t, db, `SELECT count(*) FROM orders_stock WHERE available <> initial`), "stock released")
	for _, e := range []string{"shipping scheduled", "shipping cancel", "billing charge", "billing refund", "inventory reserve", "inventory release"} {
		svc, action, _ := strings.Cut(e, " ")
		require.Equal(t, 1, count(t, db, `SELECT count(*) FROM orders_effects WHERE order_id = 'late-1' AND service = $1 AND action = $2`, svc, action), e)
	}
}

func rowStatus(t *testing.T, db *sql.DB, q string) string {
	t.Helper()
	var s string
	require.NoError(t, db.QueryRow(q).Scan(&s), q)
	return s
}
