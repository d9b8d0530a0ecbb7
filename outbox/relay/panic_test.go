package relay

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/runner"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// panickingPublisher panics on any call carrying a message whose payload
// is "poison" (a publisher's bug that one event triggers), counting the
// panics, and records the messages of the calls that return.
type panickingPublisher struct {
	mu     sync.Mutex
	got    []string // payloads accepted
	panics atomic.Int64
}

func (p *panickingPublisher) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if string(m.Payload) == "poison" {
			p.panics.Add(1)
			panic("publisher bug: cannot encode " + m.UUID)
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.got = append(p.got, string(m.Payload))
	}
	return nil
}

func (p *panickingPublisher) Close() error { return nil }

func (p *panickingPublisher) panicked() int64 { return p.panics.Load() }

func (p *panickingPublisher) accepted() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.got...)
}

// panickingBatchPublisher is the same with PublishBatch (batch.Publisher).
type panickingBatchPublisher struct{ panickingPublisher }

func (p *panickingBatchPublisher) PublishBatch(topic string, msgs ...*message.Message) error {
	return p.Publish(topic, msgs...)
}

// A publisher that panics on one event does not end the relay: the panic
// is recovered and counted, the event's row is failed with the panic in
// last_error (for `millwright outbox retry-failed`), the other events of
// its batch (its own call's included) and later events go out. Before, the
// panic in the relay's publish goroutine ended the process, and its
// restart claimed the same row and died again.
func TestRelay_PublisherPanicFailsTheRowAndGoesOn(t *testing.T) {
	t.Parallel()
	type publisher interface {
		message.Publisher
		accepted() []string
		panicked() int64
	}
	for name, c := range map[string]struct {
		pub publisher
		// deadLetters: Config.DeadLetterTopic, whose copy of the
		// failed row carries the poison message again (and panics too).
		deadLetters string
	}{
		"Publish":                  {pub: &panickingPublisher{}},
		"PublishBatch":             {pub: &panickingBatchPublisher{}},
		"Publish, DeadLetterTopic": {pub: &panickingPublisher{}, deadLetters: "relay.dlq"},
	} {
		pub := c.pub
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			// One topic, so the poison row shares its broker call with
			// the others (and with its own aggregate's next row).
			var want []string
			for i := range 6 {
				payload := fmt.Sprintf(`{"n": %d}`, i) // as jsonb prints it
				if i == 2 {
					payload = "poison"
				} else {
					want = append(want, payload)
				}
				require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateID: fmt.Sprintf("o-%d", i%3), Payload: []byte(payload)}))
			}
			reg := prometheus.NewRegistry()
			logs := watermill.NewCaptureLogger()
			startRelay(t, b.db, pub, Config{PollInterval: 10 * time.Millisecond, Registerer: reg, Logger: logs, DeadLetterTopic: c.deadLetters,
				Retry: retry.Policy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxElapsedTime: time.Hour}})

			eventually(t, time.Minute, func() bool {
				return count(t, b.db, "status = 'failed'") == 1 && count(t, b.db, "status = 'published'") == 5
			}, "want the poison row failed and the 5 others published")
			var lastErr string
			require.NoError(t, b.db.QueryRow(`SELECT last_error FROM millwright_outbox WHERE status = 'failed'`).Scan(&lastErr))
			require.Contains(t, lastErr, "the publisher panicked on event")
			require.Contains(t, lastErr, "publisher bug: cannot encode")
			require.Subset(t, pub.accepted(), want, "every other event reached the broker")
			require.NotContains(t, pub.accepted(), "poison")

			if c.deadLetters != "" {
				eventually(t, time.Minute, func() bool {
					for _, e := range logs.Captured()[watermill.ErrorLogLevel] {
						if strings.Contains(e.Msg, "publishing to the dead-letter topic failed") && e.Err != nil && strings.Contains(e.Err.Error(), "recovered from a panic") {
							return true
						}
					}
					return false
				}, "the dead-letter copy's panic is recovered and logged")
			}
			require.Equal(t, outbox.MetricLoopPanics, runner.MetricPanics)
			panics := pub.panicked()
			require.GreaterOrEqual(t, panics, int64(1))
			require.Equal(t, float64(panics), testutil.ToFloat64(counterOf(t, reg, outbox.MetricLoopPanics, "outbox.Relay")),
				"every panic is counted")
			found := false
			for _, e := range logs.Captured()[watermill.ErrorLogLevel] {
				found = found || (strings.Contains(e.Msg, "recovered from a panic publishing") && e.Fields["rows"] == 1)
			}
			require.True(t, found, "the panic on the row alone is logged with the row")

			// The relay still runs.
			require.NoError(t, outbox.AddOutsideTx(ctx, postgres.From(b.db), outbox.Event{Topic: "orders", AggregateID: "o-9", Payload: []byte(`{"n":9}`)}))
			eventually(t, time.Minute, func() bool { return count(t, b.db, "status = 'published'") == 6 }, "a later event is published")
		})
	}
}

// counterOf returns the child of the counter vector name in reg with the
// component label.
func counterOf(t *testing.T, reg *prometheus.Registry, name, component string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "component" && l.GetValue() == component {
					c := prometheus.NewCounter(prometheus.CounterOpts{Name: "copy", Help: "h"})
					c.Add(m.GetCounter().GetValue())
					return c
				}
			}
		}
	}
	t.Fatalf("no %s{component=%q} in the registry", name, component)
	return nil
}
