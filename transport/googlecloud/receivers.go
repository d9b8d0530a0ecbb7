package googlecloud

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"google.golang.org/api/iterator"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrNoSubscription is returned by Publish, unless Config.AllowUnreceived,
// when the topic has no subscription (or does not exist): Pub/Sub would
// accept the message and keep it for nobody.
var ErrNoSubscription = errors.New("topic has no subscription")

// receivers remembers the topics known to have a subscription. Only a
// positive answer is kept: a topic without one is asked about again on its
// next publish, so the first publish after a group subscribes goes through.
// A subscription deleted later is not noticed (Pub/Sub has no cheap way to
// watch for that); the zero value is ready to use.
type receivers struct {
	mu   sync.Mutex
	seen map[string]struct{}
}

func (r *receivers) known(topic string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.seen[topic]
	return ok
}

func (r *receivers) remember(topic string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.seen == nil {
		r.seen = map[string]struct{}{}
	}
	r.seen[topic] = struct{}{}
}

// checkReceivers fails, unless Config.AllowUnreceived, a publish to a topic
// that no subscription would receive. The check is one
// ListTopicSubscriptions call, bounded by the first message's context and
// PublishTimeout, made until the topic is seen to have a subscription.
func (p *Publisher) checkReceivers(topic string, msgs []*message.Message) error {
	if p.t.cfg.AllowUnreceived || len(msgs) == 0 || p.recv.known(topic) {
		return nil
	}
	ctx, cancel := context.WithTimeout(msgs[0].Context(), p.t.cfg.PublishTimeout)
	defer cancel()
	_, err := p.t.admin.Topic(topic).Subscriptions(ctx).Next()
	switch {
	case ctx.Err() != nil:
		// gRPC's Canceled and DeadlineExceeded statuses do not wrap the
		// context's error: return that one, for errors.Is.
		return fmt.Errorf("googlecloud: publishing to %s: checking that the topic has a subscription (PublishTimeout %s): %w", topic, p.t.cfg.PublishTimeout, ctx.Err())
	case err == nil:
		p.recv.remember(topic)
		return nil
	case errors.Is(err, iterator.Done):
		return fmt.Errorf("googlecloud: publishing to %s: %w: nothing would receive the message (subscribe a group first, list it in Config.DeclareGroups or MILLWRIGHT_DECLARE_GROUPS, or set AllowUnreceived, env MILLWRIGHT_PUBSUB_ALLOW_UNRECEIVED)",
			topic, ErrNoSubscription)
	case status.Code(err) == codes.NotFound:
		return fmt.Errorf("googlecloud: publishing to %s: the topic does not exist, so %w: nothing would receive the message (subscribe a group first, list it in Config.DeclareGroups or MILLWRIGHT_DECLARE_GROUPS, or set AllowUnreceived, env MILLWRIGHT_PUBSUB_ALLOW_UNRECEIVED)",
			topic, ErrNoSubscription)
	case status.Code(err) == codes.PermissionDenied:
		return fmt.Errorf("googlecloud: publishing to %s: cannot check that the topic has a subscription (grant pubsub.topics.listSubscriptions, e.g. roles/pubsub.viewer, or set AllowUnreceived, env MILLWRIGHT_PUBSUB_ALLOW_UNRECEIVED): %w",
			topic, err)
	}
	return fmt.Errorf("googlecloud: publishing to %s: checking that the topic has a subscription: %w", topic, err)
}
