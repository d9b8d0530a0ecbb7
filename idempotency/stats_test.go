package idempotency_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
)

// Stats counts what the Prometheus counters count, with or without a
// Registerer; without one nothing is registered anywhere (the one rule of
// every component: nil registers nothing).
func TestStatsCountWithoutPrometheus(t *testing.T) {
	t.Parallel()
	for _, reg := range []*prometheus.Registry{nil, prometheus.NewRegistry()} {
		cfg := idempotency.Config{Consumer: "billing"}
		if reg != nil {
			cfg.Registerer = reg
		}
		dedup, err := idempotency.NewMiddleware(idempotency.NewMemoryStore(), cfg)
		require.NoError(t, err)
		h := dedup.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
		for _, id := range []string{"e-1", "e-1", "e-2", "e-1"} {
			_, err := h(idempotencytest.NewMessage(id, nil))
			require.NoError(t, err)
		}
		require.Equal(t, idempotency.Stats{Processed: 2, Duplicates: 2}, dedup.Stats())
		if reg != nil {
			n, err := testutil.GatherAndCount(reg, idempotency.MetricDuplicates)
			require.NoError(t, err)
			require.Equal(t, 1, n)
		}
	}
}
