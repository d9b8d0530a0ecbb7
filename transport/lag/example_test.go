package lag_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/transport/lag"
)

// fixed is a reader of fixed rows (a transport's reader in a service:
// kafka.NewLagReader, amqp.NewLagReader).
type fixed struct {
	rows []lag.Partition
	err  error
}

func (f fixed) Lag(context.Context) ([]lag.Partition, error) { return f.rows, f.err }

// A collector over two readers, one of which fails: the rows of the
// other are exported, the failure counted.
func ExampleNewCollector() {
	kafkaRows := fixed{rows: []lag.Partition{{Transport: "kafka", Group: "billing", Topic: "orders", Partition: 0,
		Committed: 10, End: 1010, Lag: 1000, Unacked: -1}}}
	down := fixed{err: errors.New("amqp: dialing amqp://rabbit:5672/: connection refused")}
	reg := prometheus.NewRegistry()
	reg.MustRegister(lag.NewCollector(lag.Readers{kafkaRows, down}, lag.CollectorConfig{}))
	mfs, err := reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			fmt.Println(mf.GetName(), labels, v)
		}
	}
	// Output:
	// millwright_consumer_lag_errors_total [] 1
	// millwright_consumer_lag_messages [group=billing partition=0 topic=orders transport=kafka] 1000
}
