package kafka

import (
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
)

// The key-parallel consumer's drain bound is KeyDrainTimeout (default
// 30 s) and the group's rebalance timeout covers it (4/3), so a member
// that waits for its handlers stays in the group; a Tune that lowers the
// rebalance timeout lowers the bound with it; without KeyParallelism the
// rebalance timeout stays 3 s.
func TestKeyedDrainBound(t *testing.T) {
	t.Parallel()
	bound := func(c Config) (rebalance, drain time.Duration) {
		t.Helper()
		setDefaults(&c)
		require.NoError(t, validate(c))
		sc, err := saramaConfig(c)
		require.NoError(t, err)
		if c.KeyParallelism == 0 {
			return sc.Consumer.Group.Rebalance.Timeout, 0
		}
		s, err := newKeyedSubscriber(c, "g", sc, watermill.NopLogger{})
		require.NoError(t, err)
		return sc.Consumer.Group.Rebalance.Timeout, s.drain
	}
	c := Config{Brokers: []string{"127.0.0.1:9092"}, KeyParallelism: 4}
	r, d := bound(c)
	require.Equal(t, 40*time.Second, r)
	require.Equal(t, 30*time.Second, d)

	c.KeyDrainTimeout = 6 * time.Second
	r, d = bound(c)
	require.Equal(t, 8*time.Second, r)
	require.Equal(t, 6*time.Second, d)

	c.Tune = func(sc *sarama.Config) { sc.Consumer.Group.Rebalance.Timeout = 4 * time.Second }
	r, d = bound(c)
	require.Equal(t, 4*time.Second, r)
	require.Equal(t, 3*time.Second, d, "3/4 of a rebalance timeout Tune lowered")

	r, _ = bound(Config{Brokers: []string{"127.0.0.1:9092"}})
	require.Equal(t, 3*time.Second, r, "watermill-kafka's subscriber keeps the short rebalance timeout")

	c = Config{Brokers: []string{"127.0.0.1:9092"}, KeyParallelism: 4, KeyDrainTimeout: -time.Second}
	require.ErrorContains(t, validate(c), "KeyDrainTimeout -1s is negative")
}
