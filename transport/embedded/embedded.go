package embedded

import (
	"fmt"
	"time"

	"cloud.google.com/go/pubsub/pstest"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/googlecloud"
	"github.com/millwright/millwright/transport/kafka"
)

// Importing this package links the fakes that MILLWRIGHT_TRANSPORT=kfake
// and pstest select (kafka.Config.Fake, googlecloud.Config.Fake).
func init() {
	kafka.RegisterFake(func() ([]string, func(), error) {
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(1))
		if err != nil {
			return nil, nil, err
		}
		return c.ListenAddrs(), c.Close, nil
	})
	googlecloud.RegisterFake(func() (string, func() error, error) {
		s := pstest.NewServer()
		return s.Addr, s.Close, nil
	})
}

// KafkaCluster is an in-process fake Kafka cluster.
type KafkaCluster struct {
	// Cluster gives access to kfake's fault injection (ControlKey).
	Cluster *kfake.Cluster
}

// Kafka starts a 3-broker kfake cluster that creates topics on first use
// (extra kfake options are appended).
func Kafka(opts ...kfake.Opt) (*KafkaCluster, error) {
	base := []kfake.Opt{kfake.NumBrokers(3), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(1)}
	c, err := kfake.NewCluster(append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("embedded: starting kfake cluster: %w", err)
	}
	return &KafkaCluster{Cluster: c}, nil
}

// Config returns the transport configuration that reaches the cluster.
func (k *KafkaCluster) Config() transport.Config {
	cfg := transport.Config{Kind: transport.Kafka}
	cfg.Kafka.Brokers = k.Cluster.ListenAddrs()
	cfg.Kafka.Version = kafka.KfakeVersion // see there: kfake and newer OffsetFetch
	return cfg
}

// Close stops the cluster.
func (k *KafkaCluster) Close() error { k.Cluster.Close(); return nil }

// PubSubServer is an in-process fake Pub/Sub service.
type PubSubServer struct {
	// Server gives access to pstest's controls.
	Server *pstest.Server
	// ProjectID is the project the returned Config uses.
	ProjectID string
}

// PubSub starts a pstest server.
func PubSub() (*PubSubServer, error) {
	return &PubSubServer{Server: pstest.NewServer(), ProjectID: "millwright-dev"}, nil
}

// Config returns the transport configuration that reaches the server.
func (p *PubSubServer) Config() transport.Config {
	cfg := transport.Config{Kind: transport.GoogleCloud}
	cfg.GoogleCloud.ProjectID = p.ProjectID
	cfg.GoogleCloud.EmulatorHost = p.Server.Addr
	// A subscriber closed mid-read leaves its messages leased until the
	// extension ends; keep that short so they come back quickly.
	cfg.GoogleCloud.MaxExtension = 10 * time.Second
	return cfg
}

// Close stops the server.
func (p *PubSubServer) Close() error { return p.Server.Close() }
