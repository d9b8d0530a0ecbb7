package googlecloud_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport/googlecloud"
)

// Pub/Sub already consumes keys in parallel, which README's consumer
// section states: within one subscription, messages of different ordering
// keys are handled at the same time (here a key's first message is held
// until another key's is out too), one key's in order, one at a time;
// MaxOutstandingMessages bounds how many at once.
func TestSubscriptionHandlesKeysInParallelAndEachKeyInOrder(t *testing.T) {
	t.Parallel()
	const keys, perKey = 4, 3
	tr := openReceivers(t, func(c *googlecloud.Config) { c.MaxOutstandingMessages = keys })
	topic := "mw_keyed_" + watermill.NewShortUUID()
	sub, err := tr.Subscriber("g")
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for s := 0; s < perKey; s++ {
		for k := 0; k < keys; k++ {
			m := newMsg(fmt.Sprintf("k%d:%d", k, s))
			m.Metadata.Set(metadata.OrderingKey, fmt.Sprint("k", k))
			require.NoError(t, tr.Publisher().Publish(topic, m))
		}
	}

	var mu sync.Mutex
	next := map[string]int{}
	active := map[string]bool{}
	const inParallel = 2          // keys' first messages out at once
	var firsts []*message.Message // keys' first messages, held
	released := false
	var reorders []string
	for got := 0; got < keys*perKey; {
		var m *message.Message
		select {
		case m = <-msgs:
		case <-ctx.Done():
			t.Fatalf("%d of %d messages received; held %d first messages: %v", got, keys*perKey, len(firsts), ctx.Err())
		}
		k, s, _ := strings.Cut(string(m.Payload), ":")
		seq, _ := strconv.Atoi(s)
		mu.Lock()
		if active[k] || seq != next[k] {
			reorders = append(reorders, string(m.Payload))
		}
		active[k] = true
		mu.Unlock()
		finish := func(m *message.Message) {
			mu.Lock()
			active[k] = false
			next[k] = seq + 1
			mu.Unlock()
			m.Ack()
		}
		got++
		if seq == 0 && !released {
			// Hold it: another key's first message must still come. (Not
			// all keys': the emulator, on a loaded machine, sometimes
			// streams fewer than MaxOutstandingMessages at once; seen: 3
			// of 4 for two minutes.) With a limit of 1 the second never
			// comes and the test fails.
			firsts = append(firsts, m)
			if len(firsts) == inParallel {
				released = true
				for _, f := range firsts {
					kk, _, _ := strings.Cut(string(f.Payload), ":")
					mu.Lock()
					active[kk], next[kk] = false, 1
					mu.Unlock()
					f.Ack()
				}
			}
			continue
		}
		finish(m)
	}
	require.Len(t, firsts, inParallel, "keys' first messages were out at once")
	require.Empty(t, reorders)
}
