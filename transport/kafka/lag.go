package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/IBM/sarama"

	"github.com/millwright/millwright/transport/lag"
)

// LagConfig says whose lag a LagReader reads.
type LagConfig struct {
	// Groups are the consumer groups to read. Required: at least one.
	Groups []string
	// Topics limits the topics read. Default nil: every topic a group has
	// committed an offset on. A topic named here is read on every
	// partition, those without a commit counted from the partition's
	// oldest offset (what a new group with InitialOffset "oldest" reads).
	Topics []string
	// Keyed are the key-parallel subscribers of this process whose
	// partitions' keys in flight and waiting messages the rows carry
	// (Transport.Subscriber returns one with KeyParallelism > 0).
	Keyed []*KeyedSubscriber
}

// LagReader reads consumer groups' lag from the cluster: per group and
// partition, the committed offset against the partition's high-water
// mark. It implements lag.Reader and is safe for concurrent use.
type LagReader struct {
	cfg    LagConfig
	client sarama.Client
	admin  sarama.ClusterAdmin
	once   sync.Once
}

// NewLagReader connects to cfg's cluster (with its TLS, SASL and Tune)
// for reading lag. Close it when done.
func NewLagReader(cfg Config, lc LagConfig) (*LagReader, error) {
	if len(lc.Groups) == 0 {
		return nil, errors.New("kafka: NewLagReader: LagConfig.Groups is empty: name the consumer groups whose lag to read")
	}
	for _, g := range lc.Groups {
		if g == "" {
			return nil, errors.New("kafka: NewLagReader: LagConfig.Groups has an empty group name")
		}
	}
	setDefaults(&cfg)
	if err := validate(cfg); err != nil {
		return nil, err
	}
	sc, err := saramaConfig(cfg)
	if err != nil {
		return nil, err
	}
	client, err := sarama.NewClient(cfg.Brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("kafka: connecting to %v to read consumer lag: %w", cfg.Brokers, err)
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("kafka: the admin client to read consumer lag from %v: %w", cfg.Brokers, err)
	}
	return &LagReader{cfg: lc, client: client, admin: admin}, nil
}

// Close closes the reader's connections.
func (r *LagReader) Close() error {
	var err error
	r.once.Do(func() { err = r.admin.Close() }) // closes the client too
	return err
}

// Lag implements lag.Reader: one row per group and partition.
func (r *LagReader) Lag(ctx context.Context) ([]lag.Partition, error) {
	var out []lag.Partition
	var errs []error
	for _, g := range r.cfg.Groups {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		ps, err := r.group(g)
		out = append(out, ps...)
		if err != nil {
			errs = append(errs, err)
		}
	}
	keyed := map[string]map[topicPartition]keyedStats{}
	for _, s := range r.cfg.Keyed {
		if s != nil {
			keyed[s.group] = s.stats()
		}
	}
	for i := range out {
		if st, ok := keyed[out[i].Group][topicPartition{out[i].Topic, out[i].Partition}]; ok {
			out[i].Keyed, out[i].KeysInFlight, out[i].Waiting = true, st.keys, st.waiting
		}
	}
	lag.Sort(out)
	return out, errors.Join(errs...)
}

func (r *LagReader) group(g string) ([]lag.Partition, error) {
	var want map[string][]int32
	if len(r.cfg.Topics) > 0 {
		want = map[string][]int32{}
		for _, t := range r.cfg.Topics {
			ps, err := r.client.Partitions(t)
			if err != nil {
				return nil, fmt.Errorf("kafka: listing the partitions of topic %q: %w", t, err)
			}
			want[t] = ps
		}
	}
	resp, err := r.admin.ListConsumerGroupOffsets(g, want)
	if err != nil {
		return nil, fmt.Errorf("kafka: reading consumer group %q's committed offsets: %w", g, err)
	}
	if resp.Err != sarama.ErrNoError {
		return nil, fmt.Errorf("kafka: reading consumer group %q's committed offsets: %w", g, resp.Err)
	}
	var out []lag.Partition
	var errs []error
	for _, t := range slices.Sorted(maps.Keys(resp.Blocks)) {
		for p, b := range resp.Blocks[t] {
			if b.Err != sarama.ErrNoError {
				errs = append(errs, fmt.Errorf("kafka: group %q, topic %q partition %d: %w", g, t, p, b.Err))
				continue
			}
			end, err := r.client.GetOffset(t, p, sarama.OffsetNewest)
			if err != nil {
				errs = append(errs, fmt.Errorf("kafka: the high-water mark of topic %q partition %d: %w", t, p, err))
				continue
			}
			from := b.Offset
			if from < 0 {
				if from, err = r.client.GetOffset(t, p, sarama.OffsetOldest); err != nil {
					errs = append(errs, fmt.Errorf("kafka: the oldest offset of topic %q partition %d: %w", t, p, err))
					continue
				}
			}
			out = append(out, lag.Partition{Transport: "kafka", Group: g, Topic: t, Partition: p,
				Committed: b.Offset, End: end, Lag: max(0, end-from), Unacked: -1})
		}
	}
	return out, errors.Join(errs...)
}

var _ lag.Reader = (*LagReader)(nil)
