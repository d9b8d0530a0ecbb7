package debeziumbench

import (
	"context"
	"fmt"
	"time"

	"github.com/IBM/sarama"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

// drainAggregates spread the backlog, as the failover test does.
const drainAggregates = 1000

// drain writes the backlog after creating the slot (so that Debezium
// streams it too), lets the relay publish it, then starts the connector
// and counts its copies on the topic. The connector keeps running for the
// latency run.
func (b *bench) drain(ctx context.Context) ([]Row, error) {
	topic := b.schema + "_drain"
	if err := b.createTopic(ctx, topic); err != nil {
		return nil, err
	}
	defer b.deleteTopics(topic)
	if err := storage.EnableCapture(ctx, b.q, b.name); err != nil {
		return nil, err
	}
	if _, err := storage.CreateCaptureSlot(ctx, b.q, b.name); err != nil {
		return nil, err
	}
	if err := b.writeBacklog(ctx, topic); err != nil {
		return nil, err
	}
	relayTook, err := b.relayDrain(ctx)
	if err != nil {
		return nil, err
	}
	relayRate := float64(b.cfg.Backlog) / relayTook.Seconds()
	b.say("relay drained %d events in %s (%.0f events/s)", b.cfg.Backlog, relayTook.Round(time.Millisecond), relayRate)
	client, err := sarama.NewClient(b.cfg.Brokers, sarama.NewConfig())
	if err != nil {
		return nil, err
	}
	defer client.Close()
	start := time.Now()
	if err := b.startConnector(ctx); err != nil {
		return nil, err
	}
	running := time.Now()
	want := int64(2 * b.cfg.Backlog)
	for {
		n, err := records(client, topic)
		if err != nil {
			return nil, err
		}
		if n >= want {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("Debezium published %d of %d: %w", n-int64(b.cfg.Backlog), b.cfg.Backlog, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	dbzTook := time.Since(running)
	dbzRate := float64(b.cfg.Backlog) / dbzTook.Seconds()
	b.say("Debezium drained %d events in %s after its task ran (%s to start it) (%.0f events/s)", b.cfg.Backlog, dbzTook.Round(time.Millisecond), running.Sub(start).Round(time.Millisecond), dbzRate)
	return []Row{row(fmt.Sprintf("drain of a %d-event backlog", b.cfg.Backlog), relayRate, dbzRate, "events/s",
		fmt.Sprintf("%d aggregates; Debezium from its task running (starting it took %s); relay: one in-process relay, default relay.Config", drainAggregates, running.Sub(start).Round(time.Millisecond)))}, nil
}

// writeBacklog inserts the backlog, 1,000 events per transaction.
func (b *bench) writeBacklog(ctx context.Context, topic string) error {
	const perTx = 1000
	evs := make([]outbox.Event, 0, perTx)
	for i := 0; i < b.cfg.Backlog; i++ {
		evs = append(evs, outbox.Event{Topic: topic, AggregateType: "acct", AggregateID: fmt.Sprintf("a-%d", i%drainAggregates),
			EventType: "acct.moved", Payload: []byte(fmt.Sprintf(`{"seq":%d,"amount":125,"currency":"EUR","note":"backlog event"}`, i))})
		if len(evs) == perTx || i == b.cfg.Backlog-1 {
			if err := outbox.AddOutsideTx(ctx, postgres.From(b.db), evs...); err != nil {
				return err
			}
			evs = evs[:0]
		}
	}
	b.say("wrote a backlog of %d events", b.cfg.Backlog)
	return nil
}

// relayDrain runs one relay until nothing is pending, and returns how long
// that took.
func (b *bench) relayDrain(ctx context.Context) (time.Duration, error) {
	tr, err := b.openTransport(ctx)
	if err != nil {
		return 0, err
	}
	defer tr.Close()
	rel, err := relay.New(postgres.From(b.db), tr.Publisher(), relay.Config{})
	if err != nil {
		return 0, err
	}
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- rel.Run(ctx) }()
	defer func() { _ = rel.Close(); <-done }()
	for {
		n, err := storage.CountUnpublished(ctx, b.q)
		if err != nil {
			return 0, err
		}
		if n == 0 {
			return time.Since(start), nil
		}
		select {
		case err := <-done:
			done <- err
			return 0, fmt.Errorf("relay stopped with %d events unpublished: %w", n, err)
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
