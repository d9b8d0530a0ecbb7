package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/pubsub"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/millwright/millwright"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/googlecloud"
	"github.com/millwright/millwright/transport/transporttest"
)

// The payments of the demo, counted from the service's own tables on
// every broker: each payment is settled exactly once (one hold kept, one
// charge, one notification), or refused and compensated exactly once
// (its hold released, nothing charged, nobody notified), or, the poison
// one, dead-lettered; nothing is lost and no effect happens twice.
// transporttest picks the real brokers scripts/services.sh starts (and
// fails under MILLWRIGHT_TEST_REAL_BROKERS, as in CI, when one is not
// there).
func TestPaymentsOnEveryBroker(t *testing.T) {
	t.Parallel()
	for _, kind := range []transport.Kind{transport.Kafka, transport.AMQP, transport.GoogleCloud, transport.SQL} {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			const n = 30            // 6 refused (i%5 == 4), 1 poison (i == 0)
			schema := pgtest.New(t) // the service migrates it
			pool := schema.Pgx(t)
			name := "pay-" + strings.ToLower(watermill.NewShortUUID()[:8])
			tcfg := transporttest.Config(t, kind)
			cleanUp(t, kind, tcfg, name)
			s, err := newService(postgres.Pgx(pool), millwright.Config{Name: name, Transport: tcfg, DatabaseURL: schema.URL, Grace: 10 * time.Second,
				Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			var out strings.Builder
			require.NoError(t, demo(ctx, s, n, &out), "payments on %s: %s", kind, out.String())
			require.Equal(t, "payments=30 settled=23 failed=6 dead_letters=1 lost=0 doubled=0\n", out.String())

			// Per payment, from the consumers' tables.
			rows, err := pool.Query(ctx, `SELECT p.id, p.state,
				(SELECT count(*) FROM payments_holds h WHERE h.payment_id = p.id AND NOT h.released),
				(SELECT count(*) FROM payments_holds h WHERE h.payment_id = p.id AND h.released),
				(SELECT count(*) FROM payments_charges c WHERE c.payment_id = p.id AND NOT c.refunded),
				(SELECT count(*) FROM payments_notifications n WHERE n.payment_id = p.id)
				FROM payments p ORDER BY p.id`)
			require.NoError(t, err)
			seen := 0
			for rows.Next() {
				var id, state string
				var held, released, charged, notified int
				require.NoError(t, rows.Scan(&id, &state, &held, &released, &charged, &notified))
				got := []int{held, released, charged, notified}
				switch i := seen; {
				case i == 0:
					require.Equal(t, []int{0, 0, 0, 0}, got, "%s (poison) has effects", id)
					require.Equal(t, "submitted", state, id)
				case i%5 == 4:
					require.Equal(t, []int{0, 1, 0, 0}, got, "%s (refused): held, released, charged, notified", id)
					require.Equal(t, "failed", state, id)
				default:
					require.Equal(t, []int{1, 0, 1, 1}, got, "%s: held, released, charged, notified", id)
					require.Equal(t, "settled", state, id)
				}
				seen++
			}
			require.NoError(t, rows.Err())
			require.Equal(t, n, seen)
			var deadID string
			require.NoError(t, pool.QueryRow(ctx, `SELECT convert_from(payload, 'UTF8')::jsonb->>'id' FROM millwright_dead_letters`).Scan(&deadID))
			require.Equal(t, "p0000", deadID)
		})
	}
}

// cleanUp deletes, at the end of the test, what the run leaves on a
// shared broker: RabbitMQ's exchanges and queues, and the emulator's
// subscriptions (each one left behind costs the emulator a thread for as
// long as it runs).
func cleanUp(t *testing.T, kind transport.Kind, cfg transport.Config, name string) {
	var topics, groups []string
	for _, t := range []string{"submitted", "funds", "charges", "notifications", "replies"} {
		topics = append(topics, name+"."+t)
	}
	for _, h := range []string{"start", "funds", "charges", "notifications", "payment.replies"} {
		groups = append(groups, name+"."+h)
	}
	switch kind {
	case transport.AMQP:
		transporttest.DeleteAMQPTopology(t, topics, groups...)
	case transport.GoogleCloud:
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			gc := cfg.GoogleCloud
			opts := []option.ClientOption{option.WithoutAuthentication(), option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials()))}
			if gc.EmulatorHost != "" {
				opts = append(opts, option.WithEndpoint(gc.EmulatorHost))
			}
			cl, err := pubsub.NewClient(ctx, gc.ProjectID, opts...)
			if err != nil {
				t.Logf("cleaning up the emulator: %v", err)
				return
			}
			defer cl.Close()
			for i, topic := range topics {
				_ = cl.Subscription(googlecloud.SubscriptionName(topic, groups[i])).Delete(ctx)
				_ = cl.Topic(topic).Delete(ctx)
			}
		})
	}
}

// The measure: the service, wiring included, in at most 250 lines
// of non-test Go (the hand-wired version took 611).
func TestAtMost250Lines(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	lines := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		lines += bytes.Count(b, []byte("\n"))
	}
	require.LessOrEqual(t, lines, 250, "non-test Go lines of examples/payments")
}

// serve's HTTP surface: readiness once everything runs, metrics, the
// console behind its password, and a payment submitted over HTTP settled;
// the context's end (SIGTERM in main) stops it with nil.
func TestServe(t *testing.T) {
	t.Parallel()
	schema := pgtest.New(t)
	pool := schema.Pgx(t)
	tcfg, err := transport.ParseURL(schema.URL)
	require.NoError(t, err)
	s, err := newService(postgres.Pgx(pool), millwright.Config{Name: "payments", Transport: tcfg, DatabaseURL: schema.URL, Grace: 5 * time.Second,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.NoError(t, err)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close()) // serve listens on it again
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- serve(ctx, s, addr) }()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	require.Eventually(t, func() bool { code, _ := get("/readyz"); return code == http.StatusOK }, time.Minute, 50*time.Millisecond)
	code, body := get("/metrics")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "millwright_saga_")
	code, _ = get("/console/")
	require.Equal(t, http.StatusUnauthorized, code)

	resp, err := http.Post("http://"+addr+"/payments", "application/json", strings.NewReader(`{"id":"web-1","account":"a1","amount":250}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusAccepted, resp.StatusCode)
	require.Eventually(t, func() bool {
		var state string
		return pool.QueryRow(ctx, `SELECT state FROM payments WHERE id = 'web-1'`).Scan(&state) == nil && state == "settled"
	}, time.Minute, 50*time.Millisecond)
	cancel()
	require.NoError(t, <-served)
}
