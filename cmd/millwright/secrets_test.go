package main

import (
	"bytes"
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// thePassword is distinctive so that any appearance is a leak. The local
// Postgres trusts local connections, so URLs carrying it still connect.
const thePassword = "Sup3rS3cretPW"

// leaks collects every text the system produced during a run.
type leaks struct {
	mu    sync.Mutex
	texts map[string]string
}

func (l *leaks) add(where, text string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.texts == nil {
		l.texts = map[string]string{}
	}
	l.texts[where] += text + "\n"
}

func (l *leaks) addErr(where string, err error) {
	if err != nil {
		l.add(where, err.Error())
	}
}

func (l *leaks) check(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	require.NotEmpty(t, l.texts)
	for where, text := range l.texts {
		if strings.Contains(text, thePassword) {
			t.Errorf("password leaked in %s:\n%s", where, text)
		}
	}
}

// syncBuffer is a bytes.Buffer safe for the logger's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// withPassword returns raw with user:thePassword as its userinfo.
func withPassword(t *testing.T, raw, user string) string {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	u.User = url.UserPassword(user, thePassword)
	return u.String()
}

// TestSecretsNeverShown runs the CLI and the transports with URLs holding
// a password and greps everything they produced: stdout, stderr, errors,
// watermill logs, Prometheus metrics, the audit trail and DLQ envelopes.
func TestSecretsNeverShown(t *testing.T) {
	t.Parallel()
	var l leaks
	defer l.check(t)
	s := pgtest.New(t, dlq.Migrations(), saga.Migrations(), idempotency.Migrations(), outbox.Migrations(), audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	dbURL := withPassword(t, s.URL, "postgres")
	require.Contains(t, dbURL, thePassword)
	seedDeadLetters(t, dlq.NewStore(postgres.From(s.DB)))
	ctx := context.Background()

	t.Run("cli", func(t *testing.T) {
		badPort := "postgres://postgres:" + thePassword + "@127.0.0.1:badport/test?sslmode=disable"
		refused := "postgres://postgres:" + thePassword + "@127.0.0.1:1/test?sslmode=disable"
		amqpURL := "amqp://millwright_nobody:" + thePassword + "@127.0.0.1:5672/"
		queryPW := s.URL + "&password=" + thePassword // trusted locally: connects
		refusedQueryPW := "postgres://u@127.0.0.1:1/db?sslmode=disable&password=" + thePassword
		refusedSSLPW := "postgres://u@127.0.0.1:1/db?sslmode=disable&sslpassword=" + thePassword
		runs := []struct {
			url     string
			args    []string
			wantErr bool
		}{
			{dbURL, []string{"dlq", "list"}, false},
			{dbURL, []string{"dlq", "show", "1"}, false},
			{dbURL, []string{"dlq", "replay", "--all", "--dry-run"}, false},
			// --transport is ignored (replays go through the outbox) but
			// still recorded in the audit row: redacted.
			{dbURL, []string{"dlq", "replay", "--all", "--dry-run", "--transport", amqpURL}, false},
			{dbURL, []string{"dlq", "replay", "--all", "--dry-run", "--transport", "kafka://svc:" + thePassword + "@127.0.0.1:1?sasl=SCRAM-SHA-256&tls=maybe"}, false},
			{dbURL, []string{"dlq", "replay", "--all", "--dry-run", "--transport", "postgres://u:" + thePassword + "@127.0.0.1:badport/x"}, false},
			{dbURL, []string{"saga", "list"}, false},
			{dbURL, []string{"saga", "resolve", "nope", "--yes"}, true},
			{dbURL, []string{"idempotency", "stats"}, false},
			{dbURL, []string{"idempotency", "clean", "--yes"}, false},
			{dbURL, []string{"outbox", "status"}, false},
			{dbURL, []string{"outbox", "retry-failed", "--yes"}, false},
			{badPort, []string{"outbox", "retry-failed", "--dry-run"}, true},
			{dbURL, []string{"audit", "list"}, false},
			{badPort, []string{"dlq", "list"}, true},
			{badPort, []string{"saga", "resolve", "x", "--yes"}, true},
			{refused, []string{"idempotency", "clean", "--yes"}, true},
			// Secrets in query parameters: libpq's password= and sslpassword=.
			{queryPW, []string{"dlq", "list"}, false},
			{queryPW, []string{"clean", "--dry-run"}, false},
			{queryPW, []string{"clean", "--yes"}, false},
			{refusedQueryPW, []string{"outbox", "status"}, true},
			{refusedQueryPW, []string{"clean", "--yes"}, true},
			{refusedSSLPW, []string{"saga", "list"}, true},
			{dbURL, []string{"dlq", "replay", "--all", "--dry-run", "--transport", "postgres://u@127.0.0.1:1/x?sslmode=disable&password=" + thePassword}, false},
		}
		for _, r := range runs {
			root := map[string]func() *cobra.Command{"dlq": dlqCmd, "saga": sagaCmd, "idempotency": idempotencyCmd, "outbox": outboxCmd, "audit": auditCmd, "clean": cleanAllCmd}[r.args[0]]()
			out, errOut, err := runCLI(t, root, nil, r.url, r.args[1:]...)
			where := "millwright " + strings.Join(r.args, " ")
			l.add(where+" stdout", out)
			l.add(where+" stderr", errOut)
			l.addErr(where+" error", err)
			if r.wantErr {
				require.Error(t, err, where)
			} else {
				require.NoError(t, err, where)
			}
		}
		rows, err := audit.List(ctx, postgres.SQL(s.DB), 0)
		require.NoError(t, err)
		require.NotEmpty(t, rows)
		for _, e := range rows {
			l.add("audit row", strings.Join(e.Args, " ")+" "+e.Error)
		}
	})

	t.Run("transports", func(t *testing.T) {
		logs := &syncBuffer{}
		logger := watermill.NewStdLoggerWithOut(logs, true, true)
		defer func() { l.add("transport logs", logs.String()) }()

		kafkaAddr := transporttest.Config(t, transport.Kafka).Kafka.Brokers[0]
		opens := []struct {
			raw     string
			wantErr bool
		}{
			{dbURL, false},
			{"postgres://postgres:" + thePassword + "@127.0.0.1:1/test?sslmode=disable", true},
			{"postgres://postgres:" + thePassword + "@127.0.0.1:badport/test?sslmode=disable", true},
			{"amqp://millwright_nobody:" + thePassword + "@127.0.0.1:5672/", true},
			{"amqps://millwright_nobody:" + thePassword + "@127.0.0.1:5672/", true},
			{"kafka://svc:" + thePassword + "@" + kafkaAddr + "?sasl=SCRAM-SHA-256", true},
			{"kafka://svc:" + thePassword + "@" + kafkaAddr + "?sasl=PLAIN", true},
			{"postgres://postgres@127.0.0.1:1/test?sslmode=disable&password=" + thePassword, true},
			{dbURL + "&password=" + thePassword, false},
		}
		// Configurations whose String and Validate/Open errors must hide
		// secrets held in query parameters (SASL, emulator credentials).
		for _, raw := range []string{
			"postgres://u@127.0.0.1:1/db?sslmode=disable&password=" + thePassword,
			"postgres://u@127.0.0.1:1/db?sslmode=disable&sslpassword=" + thePassword,
			"amqp://127.0.0.1:1/?auth_password=" + thePassword,
			"gcppubsub://proj?emulator=127.0.0.1:1&credentials=" + thePassword,
			"gcppubsub://proj?emulator=127.0.0.1:1&password=%zz" + thePassword,
		} {
			cfg, err := transport.ParseURL(raw)
			l.addErr("transport.ParseURL error", err)
			if err == nil {
				l.add("transport Config.String of a query secret", cfg.String())
			}
		}
		for _, o := range opens {
			cfg, err := transport.ParseURL(o.raw)
			if err != nil {
				l.addErr("transport.ParseURL error", err)
				require.True(t, o.wantErr, "%v", err)
				continue
			}
			cfg.Logger = logger
			cfg.Kafka.ConnectTimeout = 3 * time.Second
			cfg.AMQP.ConnectTimeout = 3 * time.Second
			cfg.SQL.ConnectTimeout = 3 * time.Second
			cfg.WaitForBroker = transport.NoWait
			where := "transport " + cfg.String()
			l.add(where+" String", cfg.String())
			tr, err := transport.Open(ctx, cfg)
			l.addErr(where+" Open error", err)
			if o.wantErr {
				require.Error(t, err, where)
				continue
			}
			require.NoError(t, err, where)
			l.add(where+" Transport.String", tr.String())
			sub, err := tr.Subscriber("secrets")
			require.NoError(t, err)
			msgs, err := sub.Subscribe(ctx, "secrets_topic")
			require.NoError(t, err)
			require.NoError(t, tr.Publisher().Publish("secrets_topic", message.NewMessage(watermill.NewUUID(), []byte("x"))))
			select {
			case m := <-msgs:
				m.Ack()
			case <-time.After(30 * time.Second):
				t.Fatalf("%s: no message within 30s", where)
			}
			l.addErr(where+" Close error", tr.Close())
		}
	})

	t.Run("dlq envelope, logs and metrics", func(t *testing.T) {
		logs := &syncBuffer{}
		logger := watermill.NewStdLoggerWithOut(logs, true, true)
		reg := prometheus.NewRegistry()
		pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
		defer pubsub.Close()
		dead, err := pubsub.Subscribe(ctx, "orders.dlq")
		require.NoError(t, err)
		mw, err := dlq.NewMiddleware(pubsub, dlq.Config{Topic: func(string) string { return "orders.dlq" }, Logger: logger, Registerer: reg, Retry: retry.Policy{MaxAttempts: 2, InitialInterval: time.Millisecond}})
		require.NoError(t, err)
		idem, err := idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{Consumer: "billing", Registerer: reg, Logger: logger})
		require.NoError(t, err)
		// A handler failing the way real ones do: wrapping a connection
		// error that quotes the DSN it was given.
		_, parseErr := url.Parse("postgres://app:" + thePassword + "@db:badport/orders")
		require.Error(t, parseErr)
		handler := mw.Middleware(idem.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, errors.Join(errors.New("charging: opening ledger database"), parseErr)
		}))
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		msg.Metadata.Set(metadata.EventID, "evt-1")
		msg.SetContext(ctx)
		_, err = handler(msg)
		l.addErr("handler error returned to the router", err)
		select {
		case d := <-dead:
			d.Ack()
			for k, v := range d.Metadata {
				l.add("dlq envelope metadata "+k, v)
			}
			l.add("dlq envelope payload", string(d.Payload))
			require.NotEmpty(t, d.Metadata.Get(metadata.DeadLetterError))
			id, err := dlq.NewStore(postgres.From(s.DB)).Insert(ctx, d)
			require.NoError(t, err)
			stored, err := dlq.NewStore(postgres.From(s.DB)).Get(ctx, id)
			require.NoError(t, err)
			l.add("dlq stored error", stored.Error)
			out, errOut, err := runCLI(t, dlqCmd(), nil, dbURL, "show", strconv.FormatInt(id, 10))
			require.NoError(t, err)
			l.add("dlq show of the envelope", out+errOut)
		case <-time.After(30 * time.Second):
			t.Fatal("no dead letter within 30s")
		}
		l.add("dlq logs", logs.String())
		mfs, err := reg.Gather()
		require.NoError(t, err)
		require.NotEmpty(t, mfs)
		var b strings.Builder
		for _, mf := range mfs {
			_, err := expfmt.MetricFamilyToText(&b, mf)
			require.NoError(t, err)
		}
		l.add("prometheus metrics", b.String())
	})
}
