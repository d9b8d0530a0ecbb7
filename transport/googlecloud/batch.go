package googlecloud

import (
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
)

// batchKeys is how many ordering keys PublishBatch publishes at once.
// watermill-googlecloud's Publish waits for each message's result before
// the next, so one key's messages go one round trip each; keys in
// parallel let the client batch their messages into shared requests
// (PublishDelay) instead of one request per message. Measured through the
// relay at 2,000 events/s on the emulator: one key at a time could not
// keep up (p99 13.7 s, the backlog growing); see bench outbox --sections
// latency.
const batchKeys = 64

// PublishBatch publishes msgs to topic, each ordering key's messages one at
// a time and in order, up to batchKeys keys at once (a message without a
// key is a key of its own), and answers for each message
// (transport.BatchPublisher): a message Pub/Sub refuses for good
// (classify) fails alone, its key's messages before it stay published and
// those after it are held back (not sent: the client pauses the key after
// a failure and the key must stay in order); the other keys go on.
// Publish, which returns one error for the whole call, cannot say which
// message was refused, so the outbox relay, which publishes many rows per
// call, would have failed every one of them with the refused message's
// permanent error.
func (p *Publisher) PublishBatch(topic string, msgs ...*message.Message) error {
	if err := p.prepare(topic, msgs); err != nil {
		return err
	}
	var (
		order []string
		byKey = map[string][]int{}
	)
	for i, m := range msgs {
		key := m.Metadata.Get(metadata.OrderingKey)
		if key == "" {
			key = "\x00" + m.UUID + fmt.Sprint(i) // unordered: alone
		}
		if _, ok := byKey[key]; !ok {
			order = append(order, key)
		}
		byKey[key] = append(byKey[key], i)
	}
	var (
		mu     sync.Mutex
		failed = map[int]error{}
		wg     sync.WaitGroup
		slots  = make(chan struct{}, batchKeys)
	)
	for _, key := range order {
		slots <- struct{}{}
		wg.Add(1)
		go func(idx []int) {
			defer func() { <-slots; wg.Done() }()
			for n, i := range idx {
				err := classify(p.Publisher.Publish(topic, msgs[i]))
				if err == nil {
					continue
				}
				mu.Lock()
				failed[i] = err
				for _, j := range idx[n+1:] {
					failed[j] = fmt.Errorf("googlecloud: message %s not sent: message %s before it with ordering key %q failed; publish it again after that one",
						msgs[j].UUID, msgs[i].UUID, msgs[i].Metadata.Get(metadata.OrderingKey))
				}
				mu.Unlock()
				return
			}
		}(byKey[key])
	}
	wg.Wait()
	if len(failed) == 0 {
		return nil
	}
	return &transport.BatchError{Failed: failed}
}

var _ transport.BatchPublisher = (*Publisher)(nil)
