// Command kafkaleader prints the broker id that leads a partition, for
// scripts/kafka-cluster.sh's kill-leader verb (the broker jars the
// services script runs carry no admin tools: TopicCommand lives in
// kafka-tools, which the single broker does not need). It asks the
// cluster's metadata with Sarama, as the transport does. It is not for
// users.
//
//	kafkaleader -brokers 127.0.0.1:19092,127.0.0.1:19093 -topic T -partition 0
//
// prints "<leader id> <isr ids, comma-separated>" and exits 0, or names
// what failed on stderr and exits 1.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/IBM/sarama"
)

func main() {
	brokers := flag.String("brokers", "", "bootstrap brokers, host:port,...")
	topic := flag.String("topic", "", "topic")
	partition := flag.Int("partition", 0, "partition")
	flag.Parse()
	if *brokers == "" || *topic == "" {
		fmt.Fprintln(os.Stderr, "kafkaleader: -brokers and -topic are required")
		os.Exit(2)
	}
	leader, isr, err := lookup(strings.Split(*brokers, ","), *topic, int32(*partition))
	if err != nil {
		fmt.Fprintf(os.Stderr, "kafkaleader: %s/%d on %s: %v\n", *topic, *partition, *brokers, err)
		os.Exit(1)
	}
	ids := make([]string, len(isr))
	for i, id := range isr {
		ids[i] = fmt.Sprint(id)
	}
	fmt.Printf("%d %s\n", leader, strings.Join(ids, ","))
}

func lookup(brokers []string, topic string, partition int32) (int32, []int32, error) {
	sc := sarama.NewConfig()
	sc.ClientID = "millwright-kafkaleader"
	sc.Version = sarama.V3_6_0_0
	sc.Net.DialTimeout = 5 * time.Second
	sc.Metadata.Retry.Max = 3
	sc.Metadata.Retry.Backoff = 250 * time.Millisecond
	c, err := sarama.NewClient(brokers, sc)
	if err != nil {
		return 0, nil, err
	}
	defer func() { _ = c.Close() }()
	if err := c.RefreshMetadata(topic); err != nil {
		return 0, nil, err
	}
	b, err := c.Leader(topic, partition)
	if err != nil {
		return 0, nil, err
	}
	isr, err := c.InSyncReplicas(topic, partition)
	if err != nil {
		return 0, nil, err
	}
	return b.ID(), isr, nil
}
