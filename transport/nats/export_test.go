package nats

import "time"

// SetMetricsInterval makes the gauges refresh every d (tests).
func SetMetricsInterval(d time.Duration) { metricsInterval = d }
