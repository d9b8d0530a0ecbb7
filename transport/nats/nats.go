package nats

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millwright/millwright/failure"
)

// Transport is an open NATS JetStream transport: one connection shared by
// the publisher and every subscriber (JetStream acknowledgements are
// subjects, not tied to a connection, so a reconnected client still acks
// what it received before).
type Transport struct {
	cfg     Config
	logger  watermill.LoggerAdapter
	urlFrom string
	nc      *natsgo.Conn
	js      jetstream.JetStream
	pub     *Publisher
	metrics *metrics

	mu      sync.Mutex
	streams map[string]bool // streams known to exist
	subs    []*Subscriber
	closed  bool
}

func open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter, urlFrom string) (*Transport, error) {
	setDefaults(&cfg)
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	t := &Transport{cfg: cfg, logger: logger, urlFrom: urlFrom, streams: map[string]bool{}}
	opts := []natsgo.Option{
		natsgo.Name("millwright"),
		natsgo.Timeout(cfg.ConnectTimeout),
		natsgo.MaxReconnects(-1),
		natsgo.ReconnectWait(100 * time.Millisecond),
		natsgo.ReconnectJitter(100*time.Millisecond, time.Second),
		natsgo.DisconnectErrHandler(func(_ *natsgo.Conn, err error) {
			if err != nil {
				logger.Error("NATS connection lost; reconnecting (publishes wait for it, bounded by their context and ConnectTimeout)", err, watermill.LogFields{"nats_url": describeURL(cfg.URL)})
			}
		}),
		natsgo.ReconnectHandler(func(*natsgo.Conn) {
			logger.Info("NATS connection restored", watermill.LogFields{"nats_url": describeURL(cfg.URL)})
		}),
	}
	if cfg.TLS != nil {
		opts = append(opts, natsgo.Secure(cfg.TLS))
	}
	type result struct {
		nc  *natsgo.Conn
		err error
	}
	done := make(chan result, 1)
	go func() {
		nc, err := natsgo.Connect(cfg.URL, opts...)
		done <- result{nc, err}
	}()
	var r result
	select {
	case r = <-done:
	case <-ctx.Done():
		go func() {
			if r := <-done; r.nc != nil {
				r.nc.Close()
			}
		}()
		return nil, fmt.Errorf("nats: connecting to %s (URL from %s): %w", describeURL(cfg.URL), urlFrom, ctx.Err())
	}
	if r.err != nil {
		return nil, connectError(cfg.URL, urlFrom, r.err)
	}
	t.nc = r.nc
	if mp := int(t.nc.MaxPayload()); mp > 0 && mp < cfg.MaxPayload {
		t.nc.Close()
		return nil, failure.Permanent(fmt.Errorf("nats: the server's max_payload is %d bytes, below nats.Config.MaxPayload %d: lower MaxPayload to %d (outbox.Add checks it) or raise max_payload in the server's configuration", mp, cfg.MaxPayload, mp))
	}
	js, err := jetstream.New(t.nc)
	if err != nil {
		t.nc.Close()
		return nil, fmt.Errorf("nats: %w", err)
	}
	t.js = js
	actx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	if _, err := js.AccountInfo(actx); err != nil {
		t.nc.Close()
		if errors.Is(err, jetstream.ErrJetStreamNotEnabled) || errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
			return nil, failure.Permanent(fmt.Errorf("nats: %s has no JetStream (URL from %s): %w (start nats-server with -js, or enable JetStream for the account)", describeURL(cfg.URL), urlFrom, err))
		}
		return nil, fmt.Errorf("nats: asking %s for its JetStream account (URL from %s): %w", describeURL(cfg.URL), urlFrom, err)
	}
	t.metrics = newMetrics(t)
	t.pub = &Publisher{t: t, closing: make(chan struct{})}
	return t, nil
}

// connectError says why connecting failed; a refusal waiting cannot fix
// (credentials) is marked failure.Permanent.
func connectError(url, urlFrom string, err error) error {
	host := describeURL(url)
	switch {
	case errors.Is(err, natsgo.ErrAuthorization), errors.Is(err, natsgo.ErrAuthExpired), errors.Is(err, natsgo.ErrAuthRevoked),
		strings.Contains(strings.ToLower(err.Error()), "authorization violation"):
		return failure.Permanent(fmt.Errorf("nats: %s refused the credentials of the URL (from %s): %w (fix them in %s)", host, urlFrom, err, urlFrom))
	case errors.Is(err, natsgo.ErrSecureConnRequired), errors.Is(err, natsgo.ErrSecureConnWanted):
		return failure.Permanent(fmt.Errorf("nats: %s and this client disagree on TLS (URL from %s): %w (use tls:// or set nats.Config.TLS to match the server)", host, urlFrom, err))
	}
	return fmt.Errorf("nats: cannot connect to %s: %w (check %s and that nats-server runs with -js)", host, err, urlFrom)
}

// Publisher returns the transport's publisher (a transport.BatchPublisher).
func (t *Transport) Publisher() message.Publisher { return t.pub }

// Subscriber returns a subscriber of consumer group group: one durable
// JetStream consumer per topic and group ("" is group "default").
func (t *Transport) Subscriber(group string) (message.Subscriber, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, errors.New("nats: transport is closed")
	}
	s := newSubscriber(t, group)
	t.subs = append(t.subs, s)
	return s, nil
}

// Close closes the subscribers, then the publisher, then the connection.
// It is idempotent.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	subs := t.subs
	t.mu.Unlock()
	for _, s := range subs {
		_ = s.Close()
	}
	_ = t.pub.Close()
	t.metrics.close()
	t.nc.Close()
	return nil
}

// Conn returns the transport's connection (for health checks).
func (t *Transport) Conn() *natsgo.Conn { return t.nc }

// StreamName is the JetStream stream of topic: the topic itself, or, when
// it has a dot (which stream names cannot have), the topic with dots as
// underscores and 8 hex digits of its hash, so that "a.b" and "a_b" do not
// share a stream. Its subject is the topic.
func StreamName(topic string) string {
	if !strings.Contains(topic, ".") {
		return topic
	}
	h := sha256.Sum256([]byte(topic))
	return strings.ReplaceAll(topic, ".", "_") + "_" + hex.EncodeToString(h[:4])
}

// ConsumerName is the durable consumer of group on a topic's stream
// (group "" is "default"; dots as in StreamName).
func ConsumerName(group string) string {
	if group == "" {
		return "default"
	}
	return StreamName(group)
}

// streamConfig is the stream the transport creates for topic.
func (t *Transport) streamConfig(topic string) jetstream.StreamConfig {
	maxAge := t.cfg.MaxAge
	if maxAge < 0 {
		maxAge = 0
	}
	return jetstream.StreamConfig{
		Name:        StreamName(topic),
		Description: "millwright topic " + topic,
		Subjects:    []string{topic},
		Retention:   jetstream.LimitsPolicy,
		Storage:     jetstream.FileStorage,
		Replicas:    t.cfg.Replicas,
		MaxAge:      maxAge,
		Duplicates:  t.cfg.DuplicateWindow,
		Discard:     jetstream.DiscardOld,
	}
}

// ensureStream creates topic's stream unless it exists (an existing
// stream keeps its settings: an operator's changes are not undone).
func (t *Transport) ensureStream(ctx context.Context, topic string) (jetstream.Stream, error) {
	sc := t.streamConfig(topic)
	ctx, cancel := context.WithTimeout(ctx, t.cfg.ConnectTimeout)
	defer cancel()
	s, err := t.js.CreateStream(ctx, sc)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		s, err = t.js.Stream(ctx, sc.Name)
	}
	if err != nil {
		return nil, classifyAdmin(fmt.Errorf("nats: creating stream %s for topic %s: %w", sc.Name, topic, err))
	}
	t.mu.Lock()
	t.streams[topic] = true
	t.mu.Unlock()
	return s, nil
}

// knownStream reports whether topic's stream was created or found.
func (t *Transport) knownStream(topic string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.streams[topic]
}

func (t *Transport) forgetStream(topic string) {
	t.mu.Lock()
	delete(t.streams, topic)
	t.mu.Unlock()
}

// consumerConfig is group's durable consumer on topic's stream.
func (t *Transport) consumerConfig(topic, group string) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       ConsumerName(group),
		Description:   "millwright consumer group " + group + " of topic " + topic,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       t.cfg.AckWait,
		MaxDeliver:    t.cfg.MaxDeliver,
		MaxAckPending: t.cfg.MaxAckPending,
		FilterSubject: topic,
		ReplayPolicy:  jetstream.ReplayInstantPolicy,
		Replicas:      0, // the stream's
		// One member at a time receives the group's messages (see
		// Subscriber): the pinned client of priority group pinGroup.
		PriorityPolicy: jetstream.PriorityPolicyPinned,
		PriorityGroups: []string{pinGroup},
		PinnedTTL:      PinnedTTL(t.cfg),
	}
}

// pinGroup is the priority group every millwright subscriber pulls in.
const pinGroup = "millwright"

// pullExpiry is how long each pull request waits, so that a live member
// pulls at least this often and keeps its pin.
func pullExpiry(c Config) time.Duration { return max(time.Second, c.AckWait/3) }

// PinnedTTL is how long after a member's last pull request the server
// moves the group's pin to another member: AckWait, plus the longest a
// live member goes between pulls (AckWait/3), plus 5 s, so that a dead
// member's held messages have come back (AckWait after its last
// in-progress acknowledgement) before the next member is pinned and pulls
// them, ahead of their keys' later messages. It is also the longest a
// group waits after its member dies (RedeliveryBound).
func PinnedTTL(c Config) time.Duration {
	setDefaults(&c)
	return c.AckWait + pullExpiry(c) + 5*time.Second
}

// RedeliveryBound is how long after a member of a group dies holding
// messages its successor has them all, each key in order: PinnedTTL.
func RedeliveryBound(c Config) time.Duration { return PinnedTTL(c) }

// ensureConsumer creates or updates group's durable consumer on topic.
func (t *Transport) ensureConsumer(ctx context.Context, topic, group string) (jetstream.Consumer, error) {
	s, err := t.ensureStream(ctx, topic)
	if err != nil {
		return nil, err
	}
	cc := t.consumerConfig(topic, group)
	ctx, cancel := context.WithTimeout(ctx, t.cfg.ConnectTimeout)
	defer cancel()
	c, err := s.CreateOrUpdateConsumer(ctx, cc)
	if err != nil {
		return nil, classifyAdmin(fmt.Errorf("nats: creating durable consumer %s (group %q) on stream %s: %w", cc.Durable, group, StreamName(topic), err))
	}
	t.metrics.watch(topic, group)
	return c, nil
}
