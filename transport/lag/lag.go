// Package lag reports how far consumers are behind their broker, for
// Prometheus and the operator console: per consumer group and partition
// for Kafka (the committed offset against the partition's high-water
// mark), per queue for RabbitMQ (messages ready, and unacknowledged where
// the management API is configured), and for the key-parallel consumers
// the keys in flight and the messages waiting in each partition this
// process holds.
//
//	r, err := kafka.NewLagReader(cfg, kafka.LagConfig{Groups: []string{"billing"}})
//	if err != nil { ... }
//	defer r.Close()
//	reg.MustRegister(lag.NewCollector(r, lag.CollectorConfig{}))
//	h, err := console.New(db, console.Config{..., Lag: r})
//
// Each transport's reader lives in its own package (transport/kafka's
// LagReader, transport/amqp's LagReader); Readers joins several. A reader
// queries the broker when asked (at scrape time, when the page loads):
// nothing runs in the background. A broker that cannot be asked is an
// error naming it; the collector then exports
// millwright_consumer_lag_errors_total and keeps the last figures out
// rather than reporting stale ones as current.
package lag

import (
	"context"
	"errors"
	"slices"
	"strings"
)

// NoPartition is Partition.Partition for a broker without partitions (a
// RabbitMQ queue).
const NoPartition int32 = -1

// Partition is how far one consumer group is behind on one partition (or
// one queue).
type Partition struct {
	// Transport is the broker kind: "kafka", "amqp", "googlecloud".
	Transport string
	// Group is the consumer group (Kafka), or the queue's consumer group
	// (RabbitMQ: the group the queue was named for; "" for the topic's
	// own queue).
	Group string
	// Topic is the topic (Kafka), the queue (RabbitMQ) or the
	// subscription (Pub/Sub).
	Topic string
	// Partition is the Kafka partition; NoPartition elsewhere.
	Partition int32
	// Committed is the group's committed offset (the next message it
	// will read); -1 when it has committed none. End is the partition's
	// high-water mark (the offset the next message produced gets). Both
	// are -1 outside Kafka.
	Committed, End int64
	// Lag is the messages not yet consumed: End - Committed on Kafka
	// (End - the partition's oldest offset before the first commit), the
	// messages ready in the queue on RabbitMQ.
	Lag int64
	// Unacked is the messages delivered and not acknowledged yet
	// (RabbitMQ with the management API, Pub/Sub: this process's
	// outstanding messages); -1 when the broker does not say.
	Unacked int64
	// Keyed: the partition is held by a key-parallel consumer of this
	// process (KeyParallelism); KeysInFlight is its keys with messages
	// being handled or queued, Waiting the messages queued behind them.
	Keyed        bool
	KeysInFlight int
	Waiting      int
}

// Reader reads the lag of the consumers it was configured with. Lag must
// be safe for concurrent use.
type Reader interface {
	Lag(ctx context.Context) ([]Partition, error)
}

// Readers joins readers: Lag returns every reader's rows and the errors
// of those that failed, joined (the rows of the others still returned).
type Readers []Reader

// Lag implements Reader.
func (rs Readers) Lag(ctx context.Context) ([]Partition, error) {
	var out []Partition
	var errs []error
	for _, r := range rs {
		if r == nil {
			continue
		}
		ps, err := r.Lag(ctx)
		out = append(out, ps...)
		errs = append(errs, err)
	}
	Sort(out)
	return out, errors.Join(errs...)
}

// Sort orders ps by transport, group, topic and partition.
func Sort(ps []Partition) {
	slices.SortFunc(ps, func(a, b Partition) int {
		if c := strings.Compare(a.Transport, b.Transport); c != 0 {
			return c
		}
		if c := strings.Compare(a.Group, b.Group); c != 0 {
			return c
		}
		if c := strings.Compare(a.Topic, b.Topic); c != 0 {
			return c
		}
		return int(a.Partition) - int(b.Partition)
	})
}
