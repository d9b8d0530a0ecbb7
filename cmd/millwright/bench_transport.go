package main

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/benchtransport"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/embedded"
)

func init() {
	cmd := &cobra.Command{
		Use:   "transport",
		Short: "Publish and consume N messages through each transport kind, beside Watermill built directly",
		Long: `Publishes and consumes --messages messages of --payload bytes through each
transport kind, with 1 and 8 publishers, first through millwright's transport
package and then through Watermill's publisher and subscriber built directly
with the same settings, alternating, --runs times. Prints the median msgs/s of
each and their ratio (millwright / watermill; 1.00 means no cost).

Kafka runs on an embedded kfake cluster and Pub/Sub on an embedded pstest
server unless --kafka-brokers / --pubsub-emulator name real ones. RabbitMQ and
Postgres are the local servers (--amqp-url, --database-url); Postgres work
happens in a scratch schema that is dropped afterwards.`,
		RunE: runBenchTransport,
	}
	cmd.Flags().String("kinds", "gochannel,sql,amqp,kafka,googlecloud", "comma-separated kinds to measure")
	cmd.Flags().String("publishers", "1,8", "comma-separated publisher goroutine counts")
	cmd.Flags().Int("messages", 2000, "messages per run")
	cmd.Flags().Int("runs", 3, "runs per layer; the median is printed")
	cmd.Flags().Int("payload", 300, "payload size in bytes")
	cmd.Flags().String("amqp-url", "amqp://guest:guest@127.0.0.1:5672/", "RabbitMQ URL")
	cmd.Flags().String("kafka-brokers", "", "real Kafka brokers (default: embedded kfake)")
	cmd.Flags().String("pubsub-emulator", "", "real Pub/Sub emulator host:port (default: embedded pstest)")
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	addDatabaseFlag(cmd)
	benchCmd.AddCommand(cmd)
}

func runBenchTransport(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	f := cmd.Flags()
	kinds, _ := f.GetString("kinds")
	pubList, _ := f.GetString("publishers")
	n, _ := f.GetInt("messages")
	runs, _ := f.GetInt("runs")
	payload, _ := f.GetInt("payload")
	asJSON, _ := f.GetBool("json")
	if n < 1 || runs < 1 || payload < 0 {
		return fmt.Errorf("--messages and --runs must be positive and --payload not negative")
	}
	var pubs []int
	for _, s := range strings.Split(pubList, ",") {
		p, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || p < 1 {
			return fmt.Errorf("--publishers %q: want positive integers separated by commas", pubList)
		}
		pubs = append(pubs, p)
	}

	configs := map[transport.Kind]transport.Config{}
	for _, k := range strings.Split(kinds, ",") {
		kind := transport.Kind(strings.TrimSpace(k))
		switch kind {
		case transport.GoChannel:
			configs[kind] = transport.Config{Kind: kind}
		case transport.AMQP:
			u, _ := f.GetString("amqp-url")
			c := transport.Config{Kind: kind}
			c.AMQP.URL = u
			configs[kind] = c
		case transport.Kafka:
			c := transport.Config{Kind: kind}
			if b, _ := f.GetString("kafka-brokers"); b != "" {
				c.Kafka.Brokers = strings.Split(b, ",")
			} else {
				kc, err := embedded.Kafka()
				if err != nil {
					return err
				}
				defer kc.Close()
				c = kc.Config()
			}
			configs[kind] = c
		case transport.GoogleCloud:
			var c transport.Config
			if h, _ := f.GetString("pubsub-emulator"); h != "" {
				c = transport.Config{Kind: kind}
				c.GoogleCloud.ProjectID, c.GoogleCloud.EmulatorHost = "millwright-bench", h
			} else {
				ps, err := embedded.PubSub()
				if err != nil {
					return err
				}
				defer ps.Close()
				c = ps.Config()
			}
			configs[kind] = c
		case transport.SQL:
			admin, err := openDB(cmd)
			if err != nil {
				return err
			}
			defer admin.Close()
			u, _ := f.GetString("database-url")
			_, scratch, drop, err := scratchSchema(ctx, admin, databaseURL(u), "bench")
			if err != nil {
				return err
			}
			defer drop()
			c := transport.Config{Kind: kind}
			c.SQL.URL = scratch
			configs[kind] = c
		default:
			return fmt.Errorf("--kinds: invalid transport %q: want one of kafka, amqp, googlecloud, sql, gochannel", k)
		}
	}

	out := cmd.OutOrStdout()
	if !asJSON {
		fmt.Fprintf(out, "transport benchmark: %d messages of %d bytes, median of %d runs, publish start to last ack\n", n, payload, runs)
		fmt.Fprintf(out, "%-12s %10s %17s %16s %7s\n", "kind", "publishers", "millwright msg/s", "watermill msg/s", "ratio")
	}
	err := benchtransport.Run(ctx, benchtransport.Options{
		Configs: configs, Publishers: pubs, Messages: n, Runs: runs, Payload: payload,
	}, func(r benchtransport.Row) {
		if asJSON {
			_ = json.NewEncoder(out).Encode(r)
			return
		}
		fmt.Fprintf(out, "%-12s %10d %17.0f %16.0f %7.3f\n", r.Kind, r.Publishers, r.Millwright, r.Watermill, r.Ratio)
	})
	return err
}
