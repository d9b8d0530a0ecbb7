package outboxbench

import (
	"context"
	"sort"
	"sync"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// spanLog records, per message id, when the relay's publish span of it
// started and ended (tracing.RelayPublish): on the publisher path the
// broker call and its acknowledgement, on the in-database path (sql) from
// the claim to the commit of the transaction that inserted it into the
// topic's table. With the writer's commit and the consumer's receipt it
// splits each event's latency into stages.
type spanLog struct {
	mu         sync.Mutex
	start, end map[string]time.Time
}

func newSpanLog() *spanLog {
	return &spanLog{start: map[string]time.Time{}, end: map[string]time.Time{}}
}

// provider is a tracer provider that records into l, synchronously (the
// relay ends its spans itself; no exporter, no batching).
func (l *spanLog) provider() *sdktrace.TracerProvider {
	return sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(l), sdktrace.WithSampler(sdktrace.AlwaysSample()))
}

func (l *spanLog) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (l *spanLog) OnEnd(s sdktrace.ReadOnlySpan) {
	for _, a := range s.Attributes() {
		if a.Key == "messaging.message.id" {
			l.mu.Lock()
			l.start[a.Value.AsString()], l.end[a.Value.AsString()] = s.StartTime(), s.EndTime()
			l.mu.Unlock()
			return
		}
	}
}
func (l *spanLog) Shutdown(context.Context) error   { return nil }
func (l *spanLog) ForceFlush(context.Context) error { return nil }

// sample is one event's timeline.
type sample struct {
	commit, pubStart, pubEnd, received time.Time
}

// stageNames name the three stages of a sample, in order.
var stageNames = [3]string{"commit to relay publish start (wake-up, round, claim)",
	"relay publish start to its end (broker ack; sql: move transaction to commit)",
	"publish end to consumer receipt (consumer fetch; sql: horizon, notify, query)"}

func (s sample) total() time.Duration { return max(s.received.Sub(s.commit), 0) }

// stages returns the three stage durations (a stage the span log missed,
// or that overlapped the next, counts as 0).
func (s sample) stages() [3]time.Duration {
	if s.pubStart.IsZero() {
		return [3]time.Duration{}
	}
	return [3]time.Duration{max(s.pubStart.Sub(s.commit), 0), max(s.pubEnd.Sub(s.pubStart), 0), max(s.received.Sub(s.pubEnd), 0)}
}

// attribution is the p99 tail split by stage: over the events at or
// above the p99 of the total, the mean of each stage, in milliseconds;
// and each stage's own p99.
type attribution struct {
	tailMean [3]float64
	p99      [3]float64
	tailN    int
}

func attribute(xs []sample) attribution {
	var a attribution
	if len(xs) == 0 {
		return a
	}
	sorted := append([]sample(nil), xs...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].total() < sorted[j].total() })
	tail := sorted[len(sorted)*99/100:]
	a.tailN = len(tail)
	for _, s := range tail {
		st := s.stages()
		for i := range st {
			a.tailMean[i] += ms(st[i]) / float64(len(tail))
		}
	}
	for i := range a.p99 {
		d := make([]time.Duration, len(xs))
		for j, s := range xs {
			d[j] = s.stages()[i]
		}
		sort.Slice(d, func(x, y int) bool { return d[x] < d[y] })
		a.p99[i] = ms(d[len(d)*99/100])
	}
	return a
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// lateness measures the machine: a goroutine asking to sleep 1 ms, over
// and over, records how much longer each sleep took. On a loaded machine
// (the scheduler, other processes on the cores) every stage of an event
// waits like this, several times over.
type lateness struct {
	stop func()
	done chan struct{}
	over []time.Duration
}

func startLateness() *lateness {
	ctx, cancel := context.WithCancel(context.Background())
	l := &lateness{stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(l.done)
		for ctx.Err() == nil {
			t0 := time.Now()
			time.Sleep(time.Millisecond)
			l.over = append(l.over, max(time.Since(t0)-time.Millisecond, 0))
		}
	}()
	return l
}

// result stops the probe and returns the p99 and max oversleep, in ms.
func (l *lateness) result() (p99, worst float64) {
	l.stop()
	<-l.done
	if len(l.over) == 0 {
		return 0, 0
	}
	sort.Slice(l.over, func(i, j int) bool { return l.over[i] < l.over[j] })
	return ms(l.over[len(l.over)*99/100]), ms(l.over[len(l.over)-1])
}
