package metrics_test

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/metrics"
)

// Two components of one process register the same counter on one
// registry: the second gets the first's, so both count into one series.
func ExampleRegister() {
	reg := prometheus.NewRegistry()
	opts := prometheus.CounterOpts{Name: "orders_placed_total", Help: "Orders placed."}
	a, err := metrics.Register(reg, prometheus.NewCounter(opts))
	if err != nil {
		panic(err)
	}
	b, err := metrics.Register(reg, prometheus.NewCounter(opts))
	if err != nil {
		panic(err)
	}
	a.Inc()
	b.Inc()
	families, _ := reg.Gather()
	fmt.Println(families[0].GetName(), families[0].GetMetric()[0].GetCounter().GetValue())
	// Output: orders_placed_total 2
}
