// Package promreg forwards to the public package metrics, which shares
// one Prometheus Registerer between components (millwright's packages
// import it under this name).
package promreg

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/metrics"
)

// Register is metrics.Register.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	return metrics.Register(reg, c)
}

// Into is metrics.Into.
func Into[C prometheus.Collector](reg prometheus.Registerer, c C, errp *error) C {
	return metrics.Into(reg, c, errp)
}
