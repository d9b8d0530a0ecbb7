package keyed_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/keyed"
)

// Stats counts the keys with messages in flight and the messages queued
// behind each key's running one: key a runs its first message with two
// behind it, key b runs its only one.
func TestStatsCountsKeysAndWaitingMessages(t *testing.T) {
	t.Parallel()
	started := make(chan string, 8)
	release := make(chan struct{})
	p, err := keyed.NewPartition(keyed.Config{Concurrency: 4, MaxInFlight: 16}, func(ctx context.Context, key string) error {
		started <- key
		<-release
		return nil
	}, func(int64) {})
	require.NoError(t, err)
	keys, waiting := p.Stats()
	require.Equal(t, [2]int{0, 0}, [2]int{keys, waiting}, "an idle partition")
	ctx := context.Background()
	for i, k := range []string{"a", "a", "b", "a"} {
		require.NoError(t, p.Submit(ctx, k, int64(i), k))
	}
	got := map[string]bool{<-started: true, <-started: true}
	require.Equal(t, map[string]bool{"a": true, "b": true}, got, "one message of each key runs")
	keys, waiting = p.Stats()
	require.Equal(t, [2]int{2, 2}, [2]int{keys, waiting}, "keys a and b in flight, a's two later messages waiting")
	close(release)
	<-started
	<-started // a's later messages ran too
	_, _, finished := p.Drain(ctx)
	require.True(t, finished)
	keys, waiting = p.Stats()
	require.Equal(t, [2]int{0, 0}, [2]int{keys, waiting}, "every message handled")
}
