package googlecloud_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/googlecloud"
	"github.com/millwright/millwright/transport/transporttest"
)

// A subscription whose handler holds a message, neither acking nor
// nacking, while nothing else moves for longer than the redelivery bound
// is not silent: the transport logs an error naming the subscription and
// sets MetricStalled for it; once the message is acked, it logs that the
// subscription moves again and clears the gauge.
func TestSubscriptionStallIsLoggedAndExported(t *testing.T) {
	t.Parallel()
	const bound = time.Second
	googlecloud.SetStallBound(bound)
	reg := prometheus.NewRegistry()
	logs := &logRecorder{}
	cfg := transporttest.Config(t, transport.GoogleCloud)
	cfg.GoogleCloud.Registerer = reg
	cfg.Logger = logs
	tr, err := transport.Open(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	topic := "stall_" + watermill.NewShortUUID()
	sub, err := tr.Subscriber("stalls")
	require.NoError(t, err)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	require.NoError(t, tr.Publisher().Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x"))))
	var held *message.Message
	select {
	case held = <-msgs:
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery in 30s")
	}
	name := googlecloud.SubscriptionName(topic, "stalls")
	waitGauge(t, reg, googlecloud.MetricOutstanding, name, 1)
	waitGauge(t, reg, googlecloud.MetricStalled, name, 1)
	require.True(t, logs.has(watermill.ErrorLogLevel, "googlecloud: subscription "+name+" is stalled: 1 messages delivered to handlers here"), "logs: %v", logs.all())
	require.Positive(t, gaugeValue(t, reg, googlecloud.MetricLastDelivery, name))

	held.Ack()
	waitGauge(t, reg, googlecloud.MetricOutstanding, name, 0)
	waitGauge(t, reg, googlecloud.MetricStalled, name, 0)
	require.True(t, logs.has(watermill.InfoLogLevel, "googlecloud: subscription "+name+" is moving again"), "logs: %v", logs.all())
}

func gaugeValue(t *testing.T, reg *prometheus.Registry, metric, sub string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != metric {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "subscription" && l.GetValue() == sub {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{subscription=%q}", metric, sub)
	return 0
}

// waitGauge polls the gauge until it is want, for at most 30s.
func waitGauge(t *testing.T, reg *prometheus.Registry, metric, sub string, want float64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := gaugeValue(t, reg, metric, sub)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s{subscription=%q} = %v after 30s, want %v", metric, sub, got, want)
		}
		time.Sleep(50 * time.Millisecond) // polling a gauge, bounded above
	}
}

// logRecorder keeps every log line; safe for concurrent use.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logRecorder) add(lvl watermill.LogLevel, msg string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, fmt.Sprint(lvl)+" "+msg)
}

func (l *logRecorder) has(lvl watermill.LogLevel, prefix string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.msgs {
		if strings.HasPrefix(m, fmt.Sprint(lvl)+" "+prefix) {
			return true
		}
	}
	return false
}

func (l *logRecorder) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}

func (l *logRecorder) Error(msg string, _ error, _ watermill.LogFields) {
	l.add(watermill.ErrorLogLevel, msg)
}
func (l *logRecorder) Info(msg string, _ watermill.LogFields)  { l.add(watermill.InfoLogLevel, msg) }
func (l *logRecorder) Debug(msg string, _ watermill.LogFields) {}
func (l *logRecorder) Trace(msg string, _ watermill.LogFields) {}
func (l *logRecorder) With(watermill.LogFields) watermill.LoggerAdapter {
	return l
}
