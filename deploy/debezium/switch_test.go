package debezium_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/capture"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
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
				if err := outbox.AddOutsideTx(ctx, postgres.From(e.schema.DB), outbox.Event{ID: id, Topic: e.topic, AggregateType: "acct", AggregateID: agg, Payload: body}); err != nil {
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

// flakyPublisher fails every every-th Publish call (an injected broker
// error: the relay records a failed attempt, the row's retry_count
// UPDATE, and retries after its backoff), counting the failures; while
// failFirst is set it also fails the first attempt of every event,
// keeping their ids.
type flakyPublisher struct {
	message.Publisher
	every     int64
	calls     atomic.Int64
	failed    atomic.Int64
	failFirst atomic.Bool
	mu        sync.Mutex
	seen      map[string]bool
	firstIDs  []string
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.failFirst.Load() {
		p.mu.Lock()
		fresh := false
		for _, m := range msgs {
			if !p.seen[m.UUID] {
				p.seen[m.UUID], fresh = true, true
				p.firstIDs = append(p.firstIDs, m.UUID)
			}
		}
		p.mu.Unlock()
		if fresh {
			p.failed.Add(1)
			return errors.New("injected publish failure (first attempt)")
		}
	}
	if p.calls.Add(1)%p.every == 0 {
		p.failed.Add(1)
		return errors.New("injected publish failure")
	}
	return p.Publisher.Publish(topic, msgs...)
}

func (p *flakyPublisher) Close() error { return nil } // the transport's, closed by setup

// runRelay runs a relay publishing through pub until the returned stop is
// called (Close: the relay drains its in-flight claims, publishing and
// marking them).
func (e *env) runRelay(ctx context.Context, t *testing.T, pub message.Publisher) (stop func()) {
	rel, err := relay.New(postgres.From(e.schema.DB), pub, relay.Config{PollInterval: 50 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 20 * time.Millisecond, MaxInterval: 200 * time.Millisecond}})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- rel.Run(ctx) }()
	return func() {
		require.NoError(t, rel.Close())
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
// millwright's relay to Debezium and back with the public operations
// (capture.SwitchToDebezium and SwitchToRelay, the CLI's switch-to-debezium
// and switch-to-relay; docs/operations.md "Relaying with Debezium"), with
// publish failures injected into the relay all along (every 7th publish
// call fails: rows from before the slot are rewritten by their failed
// attempts while the switch waits for them, issue 40 item 3), and checks
// what a deduplicating consumer applies: every event, each aggregate's in
// order, so none was marked published unsent; duplicates are counted.
// While Debezium relays, retry-failed is refused (item 4).
func TestSwitchRelayToDebeziumAndBack(t *testing.T) {
	t.Parallel()
	e := setup(t, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	k := e.consume(t)
	w := e.write(ctx, 4, 40, 10*time.Millisecond) // about 400 events/s
	pub := &flakyPublisher{Publisher: e.tr.Publisher(), every: 7, seen: map[string]bool{}}
	stopRelay := e.runRelay(ctx, t, pub)
	until(ctx, t, "relay publishing", func() (bool, error) { return w.written.Load() > 500 && pub.failed.Load() > 0, nil })

	// To Debezium: capture on, the slot and its boundary; the relay
	// publishes every row inserted before it (failing some attempts
	// meanwhile), then stops; the connector starts on the slot, and the
	// capture tracker marks what it delivers.
	sw := capture.SwitchConfig{Slot: e.name, Publication: e.name}
	dry := sw
	dry.DryRun = true
	rep, err := capture.SwitchToDebezium(ctx, postgres.From(e.schema.DB), dry)
	require.NoError(t, err)
	require.Len(t, rep.Steps, 4, "a dry run lists every step: %v", rep.Steps)
	failedBefore := pub.failed.Load()
	pub.failFirst.Store(true) // every row the relay publishes from now on fails once first
	sw.Wait = 3 * time.Minute
	rep, err = capture.SwitchToDebezium(ctx, postgres.From(e.schema.DB), sw)
	require.NoError(t, err)
	require.True(t, rep.Ready, "%+v", rep)
	pub.failFirst.Store(false)
	failedInDrain := pub.failed.Load() - failedBefore
	// The fault of item 3 happened: rows inserted before the slot's
	// boundary were rewritten by a failed attempt while the switch waited.
	pub.mu.Lock()
	firstIDs := append([]string(nil), pub.firstIDs...)
	pub.mu.Unlock()
	var rewritten int64
	require.NoError(t, e.q.QueryRow(ctx, storage.S(`SELECT count(*) FROM millwright_outbox o, millwright_outbox_capture_slots c
		WHERE c.slot = $1::text AND o.event_id = ANY($2::text[]) AND o.retry_count > 0
		AND (o.insert_xid IS NULL OR pg_visible_in_snapshot(o.insert_xid, c.boundary_snap))`, e.name, firstIDs), &rewritten))
	require.Positive(t, rewritten, "rows from before the slot failed a publish while the switch waited (%d failures)", failedInDrain)
	stopRelay()
	atSwitch := w.written.Load()
	e.start(ctx, t)
	stopTracker := e.track(ctx, t)
	_, err = outbox.RetryFailed(ctx, postgres.From(e.schema.DB), outbox.FailedFilter{}, true)
	require.ErrorIs(t, err, outbox.ErrCaptureActive)
	until(ctx, t, "Debezium relaying", func() (bool, error) { return w.written.Load() > atSwitch+1500, nil })

	// Back: a mark the slot confirms (fewer duplicates), the connector
	// stops, the switch marks what the last confirmed mark saw and drops
	// the slot, and the relay publishes the rest.
	m1, err := storage.TakeCaptureMark(ctx, e.q)
	require.NoError(t, err)
	confirmStart := time.Now()
	until(ctx, t, "Debezium confirming the last mark", func() (bool, error) {
		var confirmed bool
		err := e.q.QueryRow(ctx, storage.S(`SELECT m.lsn <= s.confirmed_flush_lsn FROM millwright_outbox_capture_marks m, pg_replication_slots s
			WHERE m.id = $1 AND s.slot_name = $2::text`, m1.ID, e.name), &confirmed)
		return confirmed, err
	})
	confirmWait := time.Since(confirmStart)
	stopTracker()
	_, err = capture.SwitchToRelay(ctx, postgres.From(e.schema.DB), capture.SwitchConfig{Slot: e.name, Publication: e.name})
	require.ErrorContains(t, err, "stop the connector first", "refused while the connector streams")
	require.NoError(t, e.connect.Stop(ctx, e.name))
	until(ctx, t, "connector releasing the slot", func() (bool, error) {
		st, err := storage.ReadCaptureState(ctx, e.q, e.name, e.name)
		return !st.SlotActive, err
	})
	rep, err = capture.SwitchToRelay(ctx, postgres.From(e.schema.DB), capture.SwitchConfig{Slot: e.name, Publication: e.name})
	require.NoError(t, err)
	stopRelay = e.runRelay(ctx, t, pub)
	require.NoError(t, e.connect.Delete(ctx, e.name))
	atBack := w.written.Load()
	failedBack := pub.failed.Load()
	until(ctx, t, "relay relaying again", func() (bool, error) { return w.written.Load() > atBack+500, nil })
	w.halt(t)
	until(ctx, t, "relay draining", func() (bool, error) {
		n, err := storage.CountUnpublished(ctx, e.q)
		return n == 0, err
	})
	stopRelay()
	require.Positive(t, pub.failed.Load()-failedBack, "publish failures were injected after the way back")

	written := int(w.written.Load())
	recs := k.wait(ctx, t, written)
	applied, dups := firstApplied(t, recs, &w.ids)
	require.Equal(t, written, applied, "every event applied once: none lost, none marked published unsent")
	t.Logf("switch: %d events written (%d before the switch, %d before the way back), %d records, %d duplicates dropped by the consumer; "+
		"%d publish failures injected (%d while the switch waited, %d of them on rows from before the slot); "+
		"Debezium confirmed the last mark in %s; on the way back %d rows marked published, %d pending for the relay",
		written, atSwitch, atBack, len(recs), dups, pub.failed.Load(), failedInDrain, rewritten, confirmWait.Round(time.Millisecond), rep.Marked, rep.Pending)
}

// track runs an capture.Tracker (a round every 500ms) until the
// returned stop.
func (e *env) track(ctx context.Context, t *testing.T) (stop func()) {
	tr, err := capture.NewTracker(postgres.From(e.schema.DB), capture.Config{Slot: e.name, Interval: 500 * time.Millisecond})
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
