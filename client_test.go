package millwright_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
)

// unreachable is a database no test can reach (connections refused).
func unreachable(t *testing.T) postgres.DB {
	db, err := postgres.Open("postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return postgres.SQL(db)
}

// Each invalid setting is named with its fix.
func TestConfigErrorsNameTheSetting(t *testing.T) {
	t.Parallel()
	db := unreachable(t)
	for _, tc := range []struct {
		cfg  millwright.Config
		want string
	}{
		{millwright.Config{}, `Config.Name is empty: set it to the service's stable name`},
		{millwright.Config{Name: "9lives"}, `Config.Name "9lives": want 1 to 30 letters`},
		{millwright.Config{Name: "svc", Grace: time.Second}, "Config.Grace 1s: want 3s..1h"},
		{millwright.Config{Name: "svc", StartTimeout: time.Millisecond}, "Config.StartTimeout 1ms: want at least 1s, or -1"},
		{millwright.Config{Name: "svc", Park: retry.Policy{MaxAttempts: -1}}, "Config.Park has no limit"},
		{millwright.Config{Name: "svc", KeyParallelism: 5000}, "Config.KeyParallelism 5000: want 1..1024"},
		{millwright.Config{Name: "svc", MaxHandlers: -3}, "Config.MaxHandlers -3: want 1..4096"},
		{millwright.Config{Name: "svc", Retention: millwright.Retention{Sagas: time.Minute}}, "Config.Retention.Sagas 1m0s: want at least 1h"},
	} {
		_, err := millwright.NewClient(db, tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := millwright.NewClient(postgres.DB{}, millwright.Config{Name: "svc"})
	require.ErrorIs(t, err, postgres.ErrNoDB)
}

func TestRegistrationErrors(t *testing.T) {
	t.Parallel()
	c, err := millwright.NewClient(unreachable(t), millwright.Config{Name: "svc"})
	require.NoError(t, err)
	h := func(context.Context, postgres.Tx, *message.Message) error { return nil }
	require.NoError(t, c.Handle("a", "t", h, millwright.HandlerConfig{}))
	require.ErrorContains(t, c.Handle("a", "t2", h, millwright.HandlerConfig{}), `handler "a" is registered twice`)
	require.ErrorContains(t, c.Handle("b", "", h, millwright.HandlerConfig{}), `handler "b": topic is empty`)
	require.ErrorContains(t, c.Handle("b c", "t", h, millwright.HandlerConfig{}), `handler name "b c"`)
	require.ErrorContains(t, c.Participant("p", "t", nil, millwright.HandlerConfig{AtLeastOnce: true}), "use Handle")
	require.ErrorContains(t, c.Add(context.Background(), postgres.Tx{}, outbox.Event{}), "no database handle")
}

// A database that never answers: Run gives up after StartTimeout, saying
// what it waited for, and the registrations are refused from then on.
func TestRunGivesUpWaitingForTheDatabase(t *testing.T) {
	t.Parallel()
	c, err := millwright.NewClient(unreachable(t), millwright.Config{Name: "svc", StartTimeout: time.Second})
	require.NoError(t, err)
	began := time.Now()
	err = c.Run(context.Background())
	require.ErrorContains(t, err, "millwright: reaching the database: gave up after")
	require.ErrorContains(t, err, "Config.StartTimeout 1s")
	require.Less(t, time.Since(began), 30*time.Second)
	require.ErrorIs(t, c.Run(context.Background()), millwright.ErrRunning)
	require.ErrorIs(t, c.Handle("late", "t", nil, millwright.HandlerConfig{}), millwright.ErrRunning)
}

// On the sql transport: readiness follows the client's life, a
// handler's effect commits once per event, a permanent error reaches the
// dead-letter table (park's route) and the key's next message waits
// behind it, and Close returns Run's nil.
func TestClientLifecycle(t *testing.T) {
	t.Parallel()
	schema := pgtest.New(t)
	db := schema.Handles(t, pgtest.DriverPgx)
	tcfg, err := transport.ParseURL(schema.URL) // sql: in order per key, as the brokers (gochannel is not)
	require.NoError(t, err)
	c, err := millwright.NewClient(db, millwright.Config{Name: "life", Migrate: true, Transport: tcfg, Grace: 5 * time.Second})
	require.NoError(t, err)
	_, err = schema.DB.Exec(`CREATE TABLE effects (id TEXT NOT NULL)`)
	require.NoError(t, err)
	require.NoError(t, c.Handle("apply", "items", func(ctx context.Context, tx postgres.Tx, msg *message.Message) error {
		if string(msg.Payload) == "poison" {
			return failure.Permanent(errors.New("poison"))
		}
		_, err := tx.Pgx().Exec(ctx, `INSERT INTO effects (id) VALUES ($1)`, string(msg.Payload))
		return err
	}, millwright.HandlerConfig{}))
	ready := func() int {
		rec := httptest.NewRecorder()
		c.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		return rec.Code
	}
	require.Equal(t, http.StatusServiceUnavailable, ready())

	ctx := context.Background()
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	select {
	case <-c.Running():
	case err := <-errc:
		t.Fatal(err)
	}
	// Ready once the relay has completed a round, too.
	require.Eventually(t, func() bool { return ready() == http.StatusOK }, time.Minute, 20*time.Millisecond)
	require.NoError(t, db.InTx(ctx, func(tx postgres.Tx) error {
		for i, p := range []string{"a", "b", "poison", "c"} {
			key := "k1"
			if i >= 2 {
				key = "k2" // c waits behind the poison
			}
			if err := c.Add(ctx, tx, outbox.Event{Topic: "items", AggregateType: "item", AggregateID: key, Payload: []byte(p)}); err != nil {
				return err
			}
		}
		return nil
	}))
	require.Eventually(t, func() bool {
		var effects, dead, parked int
		require.NoError(t, schema.DB.QueryRow(`SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM millwright_dead_letters),
			(SELECT count(*) FROM millwright_parked_messages)`).Scan(&effects, &dead, &parked))
		return effects == 2 && dead == 1 && parked >= 1
	}, time.Minute, 50*time.Millisecond)
	var ids []string
	rows, err := schema.DB.Query(`SELECT id FROM effects ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.Equal(t, "a,b", strings.Join(ids, ","))
	rec := httptest.NewRecorder()
	c.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	for _, m := range []string{"millwright_idempotency_processed_total", "millwright_dlq_depth_messages", "millwright_park_parked_keys", "millwright_outbox_"} {
		require.Contains(t, rec.Body.String(), m)
	}
	require.NoError(t, c.Close())
	require.NoError(t, <-errc)
	require.Equal(t, http.StatusServiceUnavailable, ready())
}
