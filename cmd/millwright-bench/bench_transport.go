package main

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/benchtransport"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/transport"
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
server unless --kafka-brokers / --pubsub-emulator (or their MILLWRIGHT_
variables) name real ones; the broker column says which. RabbitMQ and
Postgres are the local servers (--amqp-url, --database-url); Postgres work
happens in a scratch schema that is dropped afterwards.`,
		RunE: runBenchTransport,
	}
	cmd.Flags().String("kinds", "gochannel,sql,amqp,kafka,googlecloud,nats", "comma-separated kinds to measure")
	cmd.Flags().String("publishers", "1,8", "comma-separated publisher goroutine counts")
	cmd.Flags().Int("messages", 2000, "messages per run")
	cmd.Flags().Int("runs", 3, "runs per layer; the median is printed")
	cmd.Flags().Int("payload", 300, "payload size in bytes")
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	addBenchBrokerFlags(cmd)
	cli.AddDatabaseFlag(cmd)
	rootCmd.AddCommand(cmd)
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

	kindList, err := benchKinds("transport", strings.Split(kinds, ","), transport.GoChannel, transport.SQL, transport.AMQP, transport.Kafka, transport.GoogleCloud, transport.NATS)
	if err != nil {
		return err
	}
	brokers, err := benchBrokersFromFlags(cmd)
	if err != nil {
		return err
	}
	configs := map[transport.Kind]transport.Config{}
	labels := map[string]string{}
	for _, kind := range kindList {
		if kind != transport.SQL {
			b, err := brokers.open(kind)
			if err != nil {
				return err
			}
			defer b.Close()
			configs[kind], labels[string(kind)] = b.Config, b.Label
			continue
		}
		admin, err := openDB(cmd)
		if err != nil {
			return err
		}
		defer admin.Close()
		u, _ := f.GetString("database-url")
		_, scratch, drop, err := benchdb.Scratch(ctx, admin, cli.DatabaseURL(u), "bench")
		if err != nil {
			return err
		}
		defer drop()
		c := transport.Config{Kind: kind}
		c.SQL.URL = scratch
		configs[kind], labels[string(kind)] = c, postgresLabel(scratch)
	}

	for _, l := range brokers.notice(kindList) {
		fmt.Fprintln(cmd.ErrOrStderr(), l)
	}
	out := cmd.OutOrStdout()
	if !asJSON {
		fmt.Fprintf(out, "transport benchmark: %d messages of %d bytes, median of %d runs, publish start to last ack\n", n, payload, runs)
		fmt.Fprintf(out, "%-12s %-26s %10s %17s %16s %7s\n", "kind", "broker", "publishers", "millwright msg/s", "watermill msg/s", "ratio")
	}
	step, end := benchProgress(cmd)
	out = cmd.OutOrStdout() // wrapped by benchProgress on a terminal
	return end(benchtransport.Run(ctx, benchtransport.Options{
		Configs: configs, Publishers: pubs, Messages: n, Runs: runs, Payload: payload, Step: step,
	}, func(r benchtransport.Row) {
		if asJSON {
			_ = json.NewEncoder(out).Encode(transportBenchRow{Row: r, Broker: labels[r.Kind]})
			return
		}
		fmt.Fprintf(out, "%-12s %-26s %10d %17.0f %16.0f %7.3f\n", r.Kind, labels[r.Kind], r.Publishers, r.Millwright, r.Watermill, r.Ratio)
	}))
}

// transportBenchRow is one --json row: benchtransport's figures and the
// broker they were measured on.
type transportBenchRow struct {
	benchtransport.Row
	// Broker is benchBroker.Label: "kfake" or "kafka 127.0.0.1:9092", ...
	Broker string `json:"broker"`
}
