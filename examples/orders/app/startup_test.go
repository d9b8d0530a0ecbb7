package app_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
)

// TestStartWaitsForABrokerThatDropsWhileStarting: RabbitMQ goes away just
// as the services start (the proxy in front of it closes every connection
// and refuses new ones for 2 s). Start retries each step with backoff,
// logging each failed attempt, instead of exiting with "cannot bind
// queue", and the services start once the broker is back.
func TestStartWaitsForABrokerThatDropsWhileStarting(t *testing.T) {
	t.Parallel()
	schema := pgtest.New(t, app.AllMigrations()...)
	proxy := newFaultProxy(t, hostPort(t, amqpURL))
	cfg := transport.Config{Kind: transport.AMQP}
	cfg.AMQP.URL = proxiedURL(t, proxy, amqpURL)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	prefix := "t" + randHex(5) + "."
	t.Cleanup(func() { deleteAMQP(t, app.NewTopics(prefix)) })
	logs := &failureLog{}
	a, err := app.New(app.Config{DB: schema.DB, DatabaseURL: schema.URL, Transport: tr, TopicPrefix: prefix, Logger: logs})
	require.NoError(t, err)

	proxy.Outage(2 * time.Second)
	startServices(t, ctx, a, app.DeadLetters, app.Billing)
	require.Positive(t, proxy.Refused(), "the outage refused nothing")
	require.Positive(t, logs.count("Startup step failed; retrying"), "no failed startup attempt was logged")
}

// TestStartGivesUpWhenItsContextEnds: with the broker away for good, Start
// returns when its context ends, naming the step it was waiting for.
func TestStartGivesUpWhenItsContextEnds(t *testing.T) {
	t.Parallel()
	schema := pgtest.New(t, app.AllMigrations()...)
	proxy := newFaultProxy(t, hostPort(t, amqpURL))
	cfg := transport.Config{Kind: transport.AMQP}
	cfg.AMQP.URL = proxiedURL(t, proxy, amqpURL)
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	prefix := "t" + randHex(5) + "."
	t.Cleanup(func() { deleteAMQP(t, app.NewTopics(prefix)) })
	a, err := app.New(app.Config{DB: schema.DB, DatabaseURL: schema.URL, Transport: tr, TopicPrefix: prefix})
	require.NoError(t, err)

	proxy.Outage(time.Hour)
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	_, err = a.Start(ctx, app.DeadLetters)
	require.Error(t, err)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, err.Error(), "dead-letter recorder")
}

// failureLog is a watermill logger that counts error messages.
type failureLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	msgs []string
}

func (l *failureLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, msg+": "+err.Error())
}

func (l *failureLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *failureLog) count(prefix string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.HasPrefix(m, prefix) {
			n++
		}
	}
	return n
}

// startServices starts the given services (all when none), stops them at
// cleanup, and returns once every one of them is running; it fails the
// test if they stop first or are not running within a minute.
func startServices(t *testing.T, ctx context.Context, a *app.App, services ...app.Service) *app.Process {
	t.Helper()
	proc, err := a.Start(ctx, services...)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, proc.Stop()) })
	select {
	case <-proc.Running():
	case <-proc.Done():
		t.Fatalf("services stopped: %v", proc.Wait())
	case <-time.After(time.Minute):
		t.Fatal("services not running after a minute")
	}
	return proc
}
