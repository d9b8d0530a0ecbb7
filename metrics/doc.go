// Package metrics registers Prometheus collectors so that several
// components of one process can share one prometheus.Registerer, as
// millwright's own do (relays, middlewares, transports, orchestrators all
// take a Config.Registerer): registering a collector whose description is
// already registered reuses the collector registered first instead of
// failing with prometheus.AlreadyRegisteredError.
//
//	gauge, err := metrics.Register(reg, dlq.NewDepthCollector(store))
//
// Guarantees. Register returns the collector to use: c itself, or the one
// of the same Go type already registered under the same descriptions (so
// two components count into one series, not two). A conflict it cannot
// resolve (the same name with other labels or help, or a collector of
// another type) is returned as prometheus reports it, with c unregistered.
// It is safe for concurrent use when reg is (prometheus.Registry is).
package metrics
