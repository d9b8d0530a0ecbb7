package debezium_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
)

type seqEvent struct {
	Agg string `json:"agg"`
	Seq int    `json:"seq"`
}

// writers write events of aggs aggregates, each aggregate's in sequence
// (seq from 1) by one goroutine, one event per transaction, until stop.
type writers struct {
	written atomic.Int64
	ids     sync.Map // event id -> seqEvent
	errs    chan error
	wg      sync.WaitGroup
	stop    chan struct{}
}

func (e *env) write(ctx context.Context, goroutines, aggs int, every time.Duration) *writers {
	w := &writers{errs: make(chan error, goroutines), stop: make(chan struct{})}
	for g := range goroutines {
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			seq := map[string]int{}
			tick := time.NewTicker(every)
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-w.stop:
					return
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				agg := fmt.Sprintf("agg-%d", g+goroutines*(i%(aggs/goroutines)))
				seq[agg]++
				ev := seqEvent{Agg: agg, Seq: seq[agg]}
				body, _ := json.Marshal(ev)
				id := fmt.Sprintf("%s-%d", agg, ev.Seq)
				if err := outbox.Add(ctx, e.schema.DB, outbox.Event{ID: id, Topic: e.topic, AggregateType: "acct", AggregateID: agg, Payload: body}); err != nil {
					w.errs <- err
					return
				}
				w.ids.Store(id, ev)
				w.written.Add(1)
			}
		}()
	}
	return w
}

func (w *writers) halt(t *testing.T) {
	close(w.stop)
	w.wg.Wait()
	select {
	case err := <-w.errs:
		t.Fatalf("writer: %v", err)
	default:
	}
}

// runRelay runs a relay until the returned stop is called (Close: the
// relay drains its in-flight claims, publishing and marking them).
func (e *env) runRelay(ctx context.Context, t *testing.T) (stop func()) {
	relay, err := outbox.NewRelay(e.schema.DB, e.tr.Publisher(), outbox.RelayConfig{PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	return func() {
		require.NoError(t, relay.Close())
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-ctx.Done():
			t.Fatal("relay did not stop")
		}
	}
}

// until polls cond every 100ms until it holds or ctx ends.
func until(ctx context.Context, t *testing.T, what string, cond func() (bool, error)) {
	t.Helper()
	for {
		ok, err := cond()
		require.NoError(t, err, what)
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: %v", what, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// TestSwitchRelayToDebeziumAndBack moves a system under write load from
// millwright's relay to Debezium and back by the procedure of
// docs/operations.md ("Relaying with Debezium"), and checks what a
// deduplicating consumer applies: every event, each aggregate's in order;
// duplicates are counted.
func TestSwitchRelayToDebeziumAndBack(t *testing.T) {
	t.Parallel()
	e := setup(t, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	k := e.consume(t)
	w := e.write(ctx, 4, 40, 10*time.Millisecond) // about 400 events/s
	stopRelay := e.runRelay(ctx, t)
	until(ctx, t, "relay publishing", func() (bool, error) { return w.written.Load() > 500, nil })

	// To Debezium: capture on, slot, a mark after the slot; the relay
	// publishes everything the mark sees, then stops; the connector
	// starts on the slot, and the capture tracker marks what it delivers.
	require.NoError(t, storage.EnableCapture(ctx, e.q, e.name))
	_, err := storage.CreateCaptureSlot(ctx, e.q, e.name)
	require.NoError(t, err)
	m0, err := storage.TakeCaptureMark(ctx, e.q)
	require.NoError(t, err)
	until(ctx, t, "relay draining the rows before the slot", func() (bool, error) {
		n, err := storage.CountPendingBefore(ctx, e.q, m0.ID)
		return n == 0, err
	})
	stopRelay()
	atSwitch := w.written.Load()
	e.start(ctx, t)
	stopTracker := e.track(ctx, t)
	until(ctx, t, "Debezium relaying", func() (bool, error) { return w.written.Load() > atSwitch+1500, nil })

	// Back: a mark, Debezium confirms past it, the connector stops, the
	// rows the last confirmed mark sees are marked published, and the relay
	// publishes the rest.
	m1, err := storage.TakeCaptureMark(ctx, e.q)
	require.NoError(t, err)
	stopTracker()
	confirmStart := time.Now()
	until(ctx, t, "Debezium confirming the last mark", func() (bool, error) {
		_, mark, err := storage.MarkCaptured(ctx, e.q, e.name)
		return mark >= m1.ID, err
	})
	confirmWait := time.Since(confirmStart)
	require.NoError(t, e.connect.Stop(ctx, e.name))
	_, _, err = storage.MarkCaptured(ctx, e.q, e.name)
	require.NoError(t, err)
	var pendingBack int64
	require.NoError(t, e.q.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox WHERE status = 'pending'`), &pendingBack))
	stopRelay = e.runRelay(ctx, t)
	require.NoError(t, e.connect.Delete(ctx, e.name))
	e.teardown(t) // slot, publication and trigger gone
	atBack := w.written.Load()
	until(ctx, t, "relay relaying again", func() (bool, error) { return w.written.Load() > atBack+500, nil })
	w.halt(t)
	until(ctx, t, "relay draining", func() (bool, error) {
		var n int64
		err := e.q.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox WHERE status <> 'published'`), &n)
		return n == 0, err
	})
	stopRelay()

	written := int(w.written.Load())
	recs := k.wait(ctx, t, written)
	applied, dups := firstApplied(t, recs, &w.ids)
	require.Equal(t, written, applied, "every event applied once: none lost")
	t.Logf("switch: %d events written (%d before the switch, %d before the way back), %d records, %d duplicates dropped by the consumer; "+
		"Debezium confirmed the last mark in %s, %d rows pending for the relay on the way back",
		written, atSwitch, atBack, len(recs), dups, confirmWait.Round(time.Millisecond), pendingBack)
}

// track runs an outbox.CaptureTracker (a round every 500ms) until the
// returned stop.
func (e *env) track(ctx context.Context, t *testing.T) (stop func()) {
	tr, err := outbox.NewCaptureTracker(e.schema.DB, outbox.CaptureConfig{Slot: e.name, Interval: 500 * time.Millisecond})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- tr.Run(ctx) }()
	return func() {
		require.NoError(t, tr.Close())
		require.NoError(t, <-done)
	}
}

// firstApplied is what a consumer that drops duplicates (package
// idempotency) applies: the first copy of each event id, in partition
// order. It fails the test when an aggregate's first copies are not its
// sequence 1, 2, 3, ..., and returns the events applied and the
// duplicates dropped.
func firstApplied(t *testing.T, recs []record, written *sync.Map) (applied, dups int) {
	t.Helper()
	seen := map[string]bool{}
	last := map[string]int{}
	for _, r := range recs {
		id := r.Headers[metadata.EventID]
		if seen[id] {
			dups++
			continue
		}
		seen[id] = true
		var ev seqEvent
		require.NoError(t, json.Unmarshal(r.Value, &ev), "record %s", id)
		want, ok := written.Load(id)
		require.True(t, ok, "record %s was never written", id)
		require.Equal(t, want, ev, "record %s", id)
		require.Equal(t, last[ev.Agg]+1, ev.Seq, "aggregate %s: applied seq %d after %d (partition %d offset %d)", ev.Agg, ev.Seq, last[ev.Agg], r.Partition, r.Offset)
		last[ev.Agg] = ev.Seq
		applied++
	}
	return applied, dups
}
