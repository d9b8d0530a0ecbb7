package park_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// fast is a park budget for tests: 5 ms between rounds, no jitter.
var fast = retry.Policy{InitialInterval: 5 * time.Millisecond, MaxInterval: 5 * time.Millisecond, Jitter: retry.JitterNone, MaxAttempts: 50}

// patient is a budget that outlasts any wait of a test (broker
// deliveries on a loaded machine): rounds every 5 to 20 ms for 10 minutes.
var patient = retry.Policy{InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond, Jitter: retry.JitterNone, MaxAttempts: -1, MaxElapsedTime: 10 * time.Minute}

var errTransient = errors.New("database unavailable")

// app is a consumer that applies each message once (a deduplicating
// consumer: only the first apply of a UUID counts) and fails the messages
// it is told to, transiently or permanently.
type app struct {
	mu        sync.Mutex
	applied   []string
	seen      map[string]bool
	failing   map[string]bool // fails transiently while set
	permanent map[string]bool
	failTimes map[string]int // fails transiently this many more calls
	calls     map[string]int
}

func newApp() *app {
	return &app{seen: map[string]bool{}, failing: map[string]bool{}, permanent: map[string]bool{}, failTimes: map[string]int{}, calls: map[string]int{}}
}

func (a *app) fail(uuids ...string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, u := range uuids {
		a.failing[u] = true
	}
}

func (a *app) heal(uuids ...string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, u := range uuids {
		delete(a.failing, u)
	}
}

func (a *app) handle(msg *message.Message) ([]*message.Message, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls[msg.UUID]++
	if a.permanent[msg.UUID] {
		return nil, failure.Permanent(errors.New("rejected by business rule"))
	}
	if a.failing[msg.UUID] {
		return nil, errTransient
	}
	if a.failTimes[msg.UUID] > 0 {
		a.failTimes[msg.UUID]--
		return nil, errTransient
	}
	if !a.seen[msg.UUID] {
		a.seen[msg.UUID] = true
		a.applied = append(a.applied, msg.UUID)
	}
	return nil, nil
}

func (a *app) appliedList() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.applied...)
}

func (a *app) callsOf(u string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.calls[u]
}

// order returns the applied UUIDs of keys, in apply order.
func (a *app) order(keep func(string) bool) []string {
	var out []string
	for _, u := range a.appliedList() {
		if keep(u) {
			out = append(out, u)
		}
	}
	return out
}

func msg(uuid, key string) *message.Message {
	m := message.NewMessage(uuid, []byte(`{"id":"`+uuid+`"}`))
	m.Metadata.Set(metadata.OrderingKey, key)
	m.SetContext(context.Background())
	return m
}

type bundle struct {
	schema *pgtest.Schema
	driver string
	store  *park.Store
	dlq    *dlq.Store
}

func setup(t *testing.T, driver string) *bundle {
	t.Helper()
	s := pgtest.New(t, audit.Migrations(), dlq.Migrations(), park.Migrations(), outbox.Migrations())
	b := &bundle{schema: s, driver: driver}
	if driver == pgtest.DriverPgx {
		b.store, b.dlq = park.NewStore(postgres.From(s.Pgx(t))), dlq.NewStore(postgres.From(s.Pgx(t)))
	} else {
		b.store, b.dlq = park.NewStore(postgres.From(s.DB)), dlq.NewStore(postgres.From(s.DB))
	}
	return b
}

// replay replays dead letters with dlq.Replay (through the outbox, as the
// CLI and the console do) and delivers what it queued to h, as a relay
// would publish it (the event id as UUID).
func (b *bundle) replay(t *testing.T, h message.HandlerFunc, opts dlq.ReplayOptions) (dlq.ReplayReport, error) {
	t.Helper()
	opts.By = audit.Operator{User: "tester"}
	rep, err := dlq.Replay(context.Background(), b.schema.Handles(t, b.driver), opts)
	if err != nil {
		return rep, err
	}
	rows, err := b.schema.DB.Query(`DELETE FROM millwright_outbox RETURNING event_id, COALESCE(payload_raw, convert_to(payload::text, 'UTF8')), metadata::text`)
	require.NoError(t, err)
	var msgs []*message.Message
	for rows.Next() {
		var id, md string
		var payload []byte
		require.NoError(t, rows.Scan(&id, &payload, &md))
		m := message.NewMessage(id, payload)
		require.NoError(t, json.Unmarshal([]byte(md), &m.Metadata))
		m.Metadata.Set(metadata.EventID, id)
		msgs = append(msgs, m)
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	for _, m := range msgs {
		m.SetContext(context.Background())
		if _, err := h(m); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// parker returns a new Parker (a fresh instance: its own handler
// registry) on the bundle's schema.
func (b *bundle) parker(t *testing.T, cfg park.Config) *park.Parker {
	t.Helper()
	if cfg.Retry == (retry.Policy{}) {
		cfg.Retry = fast
	}
	var (
		p   *park.Parker
		err error
	)
	if b.driver == pgtest.DriverPgx {
		p, err = park.New(postgres.From(b.schema.Pgx(t)), cfg)
	} else {
		p, err = park.New(postgres.From(b.schema.DB), cfg)
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// chain is what a router runs: park outside an in-place retry (2
// attempts) outside the handler.
func chain(t *testing.T, p *park.Parker, name string, h message.HandlerFunc) message.HandlerFunc {
	t.Helper()
	rm, err := retry.NewMiddleware(retry.Config{Policy: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxAttempts: 2, Jitter: retry.JitterNone}})
	require.NoError(t, err)
	return p.Middleware(name)(rm.Middleware(h))
}

// deliver runs h on m as a router would, and requires an ack.
func deliver(t *testing.T, h message.HandlerFunc, m *message.Message) {
	t.Helper()
	_, err := h(m)
	require.NoError(t, err, "message %s nacked", m.UUID)
}

// drain runs retrier rounds until no key is parked (or cond, when given,
// holds), for at most 20 s.
func (b *bundle) drain(t *testing.T, p *park.Parker, cond func() bool) {
	t.Helper()
	if cond == nil {
		cond = func() bool { return len(b.keys(t)) == 0 }
	}
	poll.Until(t, 20*time.Second, func() bool {
		_, err := p.RetryDue(context.Background())
		require.NoError(t, err)
		return cond()
	}, "parked keys drained")
}

func (b *bundle) keys(t *testing.T) []park.Key {
	t.Helper()
	ks, err := b.store.List(context.Background(), park.Filter{})
	require.NoError(t, err)
	return ks
}

// drainBy waits (20 s at most) for cond while a Run loop retries.
func (b *bundle) drainBy(t *testing.T, cond func() bool) {
	t.Helper()
	poll.Until(t, 20*time.Second, cond, "retrier progress")
}

// waitDue waits until key's head is due.
func (b *bundle) waitDue(t *testing.T, key string) {
	t.Helper()
	poll.Until(t, 30*time.Second, func() bool {
		var due bool
		require.NoError(t, b.schema.DB.QueryRow(`SELECT due_at <= now() FROM millwright_parked_keys WHERE key = '\x6b'::bytea || convert_to($1, 'UTF8')`, key).Scan(&due))
		return due
	}, "key %s due", key)
}
