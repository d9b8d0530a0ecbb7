package googlecloud

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"cloud.google.com/go/pubsub"
	"github.com/ThreeDotsLabs/watermill"
	wgc "github.com/ThreeDotsLabs/watermill-googlecloud/pkg/googlecloud"
	"github.com/ThreeDotsLabs/watermill/message"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/closers"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
)

// Config is transport.GoogleCloudConfig: the settings live in package transport, so that
// a program links only the kinds it imports.
type Config = transport.GoogleCloudConfig

// FakeStarter starts an in-process Pub/Sub and returns its address and a
// function that stops it.
type FakeStarter func() (addr string, stop func() error, err error)

var fakeStarter atomic.Pointer[FakeStarter]

// RegisterFake makes Config.Fake start servers with start. Package
// transport/embedded registers the Google client's pstest, so that
// programs which do not import it (production builds) do not link the
// fake.
func RegisterFake(start FakeStarter) { fakeStarter.Store(&start) }

func loadFake() *FakeStarter { return fakeStarter.Load() }

// FakeProjectID is the project of Config.Fake when ProjectID is empty.
const FakeProjectID = "millwright-dev"

// Lease defaults (Config.MaxExtension). A consumer that dies leaves the
// messages it held leased for at most MaxExtension after its last
// renewal; then Pub/Sub redelivers them (see the package doc).
const (
	// DefaultMaxExtension is MaxExtension's default on Pub/Sub.
	DefaultMaxExtension = time.Minute
	// EmulatorMaxExtension is MaxExtension's default on the emulator
	// (EmulatorHost or PUBSUB_EMULATOR_HOST set) and on Config.Fake.
	EmulatorMaxExtension = 10 * time.Second
	// EmulatorStreamDeadline is the gRPC deadline of each streaming pull
	// on the emulator: the client reopens the stream when it passes. The
	// emulator's bundled gRPC fails (NoSuchMethodError in its log) to
	// tell the emulator that a stream was cancelled or its connection
	// lost, so without a deadline the stream of a consumer that closed
	// or died is never ended: it keeps its share of the subscription's
	// ordering keys, which no other consumer then receives, and keeps
	// taking unkeyed messages until their leases end. A stream past its
	// deadline is ended by the emulator itself.
	EmulatorStreamDeadline = 20 * time.Second
)

// streamingPullMethod is the gRPC method of a streaming pull.
const streamingPullMethod = "/google.pubsub.v1.Subscriber/StreamingPull"

// StreamDeadline is a gRPC interceptor that gives every streaming pull a
// deadline of d, so the server ends it by itself (see
// EmulatorStreamDeadline): the transport installs it on the emulator, and
// a service that builds Google's client itself against the emulator
// needs it too (option.WithGRPCDialOption(grpc.WithChainStreamInterceptor(
// googlecloud.StreamDeadline(googlecloud.EmulatorStreamDeadline)))). The
// client's streaming pull reopens a stream that ended with
// DeadlineExceeded; its leases and acks go on over the new stream.
func StreamDeadline(d time.Duration) grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method != streamingPullMethod {
			return streamer(ctx, desc, cc, method, opts...)
		}
		ctx, cancel := context.WithTimeout(ctx, d)
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			cancel()
			return nil, err
		}
		go func() { // release the timer once the stream is done
			<-cs.Context().Done()
			cancel()
		}()
		return cs, nil
	}
}

var projectRe = regexp.MustCompile(`^[a-z][a-z0-9-]{4,28}[a-z0-9]$|^[a-zA-Z0-9._:-]+$`)

func setDefaults(c *Config) {
	if c.Fake && c.ProjectID == "" {
		c.ProjectID = FakeProjectID
	}
	if c.MaxExtension == 0 && (c.Fake || emulatorHost(*c) != "") {
		// A subscriber that closes or dies mid-read leaves its messages
		// leased until the extension ends, and the emulator leases
		// what it streams to a dead stream for the stream's ack
		// deadline, which the client sets to MaxExtension: keep it
		// short in development.
		c.MaxExtension = EmulatorMaxExtension
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = 30 * time.Second
	}
	if c.PublishDelay == 0 {
		c.PublishDelay = time.Millisecond
	}
	if c.MaxExtension == 0 {
		c.MaxExtension = DefaultMaxExtension
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 10 * time.Second
	}
}

// Validate reports configuration that cannot work, naming the field.
func validate(c Config) error {
	var errs []error
	if c.Fake && c.EmulatorHost != "" {
		errs = append(errs, fmt.Errorf("googlecloud: Fake starts its own in-process Pub/Sub, but EmulatorHost is set (%s): unset MILLWRIGHT_PUBSUB_EMULATOR_HOST, or select the emulator with gcppubsub://PROJECT?emulator=%s", c.EmulatorHost, c.EmulatorHost))
	}
	if c.Fake && loadFake() == nil {
		errs = append(errs, errors.New(`googlecloud: Fake (the in-process development fake, pstest) is not linked into this program: add import _ "github.com/millwright/millwright/transport/embedded"`))
	}
	if c.ProjectID == "" && !c.Fake {
		errs = append(errs, errors.New("googlecloud: ProjectID is empty: set it (env MILLWRIGHT_PUBSUB_PROJECT or gcppubsub://PROJECT), or use the in-process development fake (MILLWRIGHT_TRANSPORT=pstest)"))
	} else if c.ProjectID != "" && !projectRe.MatchString(c.ProjectID) {
		errs = append(errs, fmt.Errorf("googlecloud: ProjectID %q is not a valid project id", c.ProjectID))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"PublishTimeout", c.PublishTimeout}, {"PublishDelay", c.PublishDelay}, {"MaxExtension", c.MaxExtension}, {"ConnectTimeout", c.ConnectTimeout}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("googlecloud: %s %s is negative", d.name, d.v))
		}
	}
	for i, o := range c.ClientOptions {
		if _, ok := o.(option.ClientOption); !ok {
			errs = append(errs, fmt.Errorf("googlecloud: ClientOptions[%d] is a %T: want a google.golang.org/api/option.ClientOption", i, o))
		}
	}
	for _, g := range c.DeclareGroups {
		if g == "" {
			errs = append(errs, errors.New("googlecloud: DeclareGroups has an empty group name"))
		}
	}
	return errors.Join(errs...)
}

func clientOptions(c Config) []option.ClientOption {
	var opts []option.ClientOption
	if c.EmulatorHost != "" {
		opts = append(opts,
			option.WithEndpoint(c.EmulatorHost),
			option.WithoutAuthentication(),
			option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())),
			option.WithTelemetryDisabled(),
		)
	} else if c.CredentialsFile != "" {
		opts = append(opts, option.WithCredentialsFile(c.CredentialsFile))
	}
	if emulatorHost(c) != "" && !c.Fake {
		opts = append(opts, option.WithGRPCDialOption(grpc.WithChainStreamInterceptor(StreamDeadline(EmulatorStreamDeadline))))
	}
	for _, o := range c.ClientOptions {
		if o, ok := o.(option.ClientOption); ok {
			opts = append(opts, o)
		}
	}
	return opts
}

// emulatorHost is the emulator the clients reach: EmulatorHost, else
// PUBSUB_EMULATOR_HOST (which the client library honours), else "".
func emulatorHost(c Config) string {
	if c.EmulatorHost != "" {
		return c.EmulatorHost
	}
	return os.Getenv("PUBSUB_EMULATOR_HOST")
}

// contactError says what became of a first contact with what that started
// at start: refused (at once), no answer within timeout, interrupted by
// ctx (the caller's), or another failure; hint suggests the fix.
func contactError(ctx, cctx context.Context, what string, timeout time.Duration, start time.Time, err error, hint string) error {
	took := time.Since(start).Round(time.Millisecond)
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("interrupted while waiting for %s to answer (no answer after %s): %w", what, took, context.Cause(ctx))
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("%s refused the connection (%s): %w", what, hint, err)
	case cctx.Err() != nil || status.Code(err) == codes.DeadlineExceeded:
		return fmt.Errorf("%s did not answer within %s (ConnectTimeout; %s): %w", what, timeout, hint, err)
	}
	return fmt.Errorf("%s failed after %s (%s): %w", what, took, hint, err)
}

// Transport is an open Pub/Sub client pair (publisher, admin).
type Transport struct {
	cfg      Config
	logger   watermill.LoggerAdapter
	admin    *pubsub.Client
	stopFake func() error // stops Config.Fake's server; nil without one
	pub      *Publisher
	metrics  *metrics

	subs closers.Set
}

// Open creates the clients and checks, within ConnectTimeout, that the
// service answers. It makes one attempt: transport.Open is what waits for
// a service that is down (transport.Config.WaitForBroker). An error that
// waiting cannot fix (configuration, credentials) is marked
// failure.Permanent. Errors name settings as googlecloud.Config fields.
func Open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (_ *Transport, err error) {
	return open(ctx, cfg, logger, fieldSettings)
}

// open is Open with the settings' sources (transport.Config.Setting) for
// its errors.
func open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter, setting func(field string) string) (_ *Transport, err error) {
	setDefaults(&cfg)
	if err := validate(cfg); err != nil {
		return nil, failure.Permanent(err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	var stopFake func() error
	if cfg.Fake {
		cfg.EmulatorHost, stopFake, err = (*loadFake())()
		if err != nil {
			return nil, failure.Permanent(fmt.Errorf("googlecloud: starting the in-process development fake (pstest): %w", err))
		}
		defer func() {
			if err != nil {
				_ = stopFake()
			}
		}()
		logger.Info("DEVELOPMENT FAKE: in-process Pub/Sub (pstest), in memory, not for production", watermill.LogFields{"project": cfg.ProjectID, "addr": cfg.EmulatorHost})
	}
	start := time.Now()
	cctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	// gRPC retries a refused connection until the deadline: an emulator
	// that is not running would look like one that does not answer, after
	// the whole ConnectTimeout. A plain TCP connect tells them apart at once.
	if host := emulatorHost(cfg); host != "" {
		var d net.Dialer
		c, err := d.DialContext(cctx, "tcp", host)
		if err != nil {
			return nil, fmt.Errorf("googlecloud: %w", contactError(ctx, cctx, "the Pub/Sub emulator at "+host, cfg.ConnectTimeout, start, err,
				"is the emulator running there? check "+emulatorSetting(cfg, setting)))
		}
		c.Close()
	}
	admin, err := pubsub.NewClient(cctx, cfg.ProjectID, clientOptions(cfg)...)
	if err != nil {
		err = fmt.Errorf("googlecloud: creating client for project %s (from %s): %w (check %s)", cfg.ProjectID, setting("GoogleCloud.ProjectID"), err, credentialsSetting(cfg, setting))
		if cctx.Err() != nil || strings.Contains(err.Error(), "metadata") {
			// Finding the default credentials through the metadata
			// server can fail for a few seconds after a pod starts
			// (GKE Workload Identity): waiting can fix that.
			return nil, err
		}
		return nil, failure.Permanent(err)
	}
	// The gRPC connection is lazy: ask something cheap to learn whether
	// the service answers at all.
	if _, err := admin.Topic("millwright-probe").Exists(cctx); err != nil && status.Code(err) != codes.PermissionDenied {
		admin.Close()
		what := "Pub/Sub for project " + cfg.ProjectID
		hint := "check " + credentialsSetting(cfg, setting) + " and the project (from " + setting("GoogleCloud.ProjectID") + ")"
		if host := emulatorHost(cfg); host != "" {
			what += " (emulator at " + host + ")"
			hint = "check " + emulatorSetting(cfg, setting)
		}
		err = fmt.Errorf("googlecloud: %w", contactError(ctx, cctx, what, cfg.ConnectTimeout, start, err, hint))
		if status.Code(err) == codes.Unauthenticated {
			err = failure.Permanent(err) // the credentials were refused
		}
		return nil, err
	}
	wp, err := wgc.NewPublisher(wgc.PublisherConfig{
		ProjectID:             cfg.ProjectID,
		EnableMessageOrdering: true,
		EnableMessageOrderingAutoResumePublishOnError: true,
		ConnectTimeout: cfg.ConnectTimeout,
		PublishTimeout: cfg.PublishTimeout,
		PublishSettings: &pubsub.PublishSettings{
			DelayThreshold: cfg.PublishDelay,
			CountThreshold: pubsub.DefaultPublishSettings.CountThreshold,
			ByteThreshold:  pubsub.DefaultPublishSettings.ByteThreshold,
			Timeout:        cfg.PublishTimeout,
		},
		ClientOptions: clientOptions(cfg),
		Marshaler:     Marshaler{wgc.NewOrderingMarshaler(orderingKey)},
	}, logger)
	if err != nil {
		admin.Close()
		return nil, fmt.Errorf("googlecloud: creating publisher: %w", err)
	}
	t := &Transport{cfg: cfg, logger: logger, admin: admin, stopFake: stopFake, metrics: m}
	t.pub = &Publisher{Publisher: wp, t: t, declared: map[string]bool{}}
	return t, nil
}

func orderingKey(_ string, msg *message.Message) (string, error) {
	return msg.Metadata.Get(metadata.OrderingKey), nil
}

func restoreOrderingKey(key string, msg *message.Message) error {
	if key != "" {
		msg.Metadata.Set(metadata.OrderingKey, key)
	}
	return nil
}

// Marshaler wraps a watermill-googlecloud marshaler with the CloudEvents
// Pub/Sub binding in binary mode: attributes travel as Pub/Sub attributes
// named "ce-<attr>", and datacontenttype as the "Content-Type" attribute.
type Marshaler struct{ wgc.Marshaler }

// Marshal implements wgc.Marshaler.
func (m Marshaler) Marshal(topic string, msg *message.Message) (*pubsub.Message, error) {
	pm, err := m.Marshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	for k, v := range msg.Metadata {
		if w := cloudevent.PubSub.WireKey(k); w != k {
			delete(pm.Attributes, k)
			pm.Attributes[w] = v
		}
	}
	return pm, nil
}

// Unmarshaler wraps a watermill-googlecloud unmarshaler: it maps the
// CloudEvents Pub/Sub binding's attributes ("ce-<attr>" in any case,
// "Content-Type") back to the metadata.Event* keys.
type Unmarshaler struct{ wgc.Unmarshaler }

// Unmarshal implements wgc.Unmarshaler.
func (u Unmarshaler) Unmarshal(pm *pubsub.Message) (*message.Message, error) {
	msg, err := u.Unmarshaler.Unmarshal(pm)
	if err != nil {
		return nil, err
	}
	cloudevent.PubSub.Decode(msg.Metadata)
	return msg, nil
}

// SubscriptionName is the subscription of a consumer group on a topic.
func SubscriptionName(topic, group string) string {
	if group == "" {
		return topic
	}
	return topic + "_" + group
}

// Publisher returns the transport's publisher, safe for concurrent use.
func (t *Transport) Publisher() message.Publisher { return t.pub }

// maxOutstanding is Config.MaxOutstandingMessages, or the client's default.
func (t *Transport) maxOutstanding() int {
	if t.cfg.MaxOutstandingMessages != 0 {
		return t.cfg.MaxOutstandingMessages
	}
	return pubsub.DefaultReceiveSettings.MaxOutstandingMessages
}

// Subscriber returns a subscriber for consumer group `group`.
func (t *Transport) Subscriber(group string) (message.Subscriber, error) {
	sub, err := closers.Add(&t.subs, "googlecloud", func() (*Subscriber, error) {
		sub, err := wgc.NewSubscriber(wgc.SubscriberConfig{
			ProjectID:                t.cfg.ProjectID,
			GenerateSubscriptionName: func(topic string) string { return SubscriptionName(topic, group) },
			ReceiveSettings: pubsub.ReceiveSettings{
				MaxExtensionPeriod:     t.cfg.MaxExtension,
				MaxOutstandingMessages: t.maxOutstanding(),
				MaxOutstandingBytes:    pubsub.DefaultReceiveSettings.MaxOutstandingBytes,
				NumGoroutines:          pubsub.DefaultReceiveSettings.NumGoroutines,
			},
			SubscriptionConfig: pubsub.SubscriptionConfig{EnableMessageOrdering: true},
			ClientOptions:      clientOptions(t.cfg),
			Unmarshaler:        Unmarshaler{wgc.NewOrderingUnmarshaler(restoreOrderingKey)},
		}, t.logger)
		if err != nil {
			return nil, fmt.Errorf("googlecloud: creating subscriber for group %q: %w", group, err)
		}
		return &Subscriber{Subscriber: sub, t: t, group: group, closing: make(chan struct{})}, nil
	})
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return sub, nil
}

// Close closes subscribers, publisher and clients. It is idempotent.
func (t *Transport) Close() error {
	return t.subs.Close(t.pub.Close, t.admin.Close, func() error {
		if t.stopFake != nil {
			return t.stopFake()
		}
		return nil
	})
}

// Publisher is watermill-googlecloud's publisher that first creates the
// subscriptions of Config.DeclareGroups on each topic it publishes to.
type Publisher struct {
	*wgc.Publisher
	t *Transport

	mu       sync.Mutex
	declared map[string]bool
	recv     receivers
}

// Publish publishes msgs to topic, in order for each ordering key.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.prepare(topic, msgs); err != nil {
		return err
	}
	return classify(p.Publisher.Publish(topic, msgs...))
}

// prepare is what precedes a publish: the declared groups' subscriptions,
// then the check that someone will receive msgs.
func (p *Publisher) prepare(topic string, msgs []*message.Message) error {
	if len(p.t.cfg.DeclareGroups) > 0 {
		if err := p.declare(topic); err != nil {
			return err
		}
	}
	if err := p.checkReceivers(topic, msgs); err != nil {
		return err
	}
	return nil
}

func (p *Publisher) declare(topic string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.declared[topic] {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.t.cfg.ConnectTimeout)
	defer cancel()
	tp := p.t.admin.Topic(topic)
	if _, err := p.t.admin.CreateTopic(ctx, topic); err != nil && status.Code(err) != codes.AlreadyExists {
		return fmt.Errorf("googlecloud: creating topic %s: %w", topic, err)
	}
	for _, g := range p.t.cfg.DeclareGroups {
		name := SubscriptionName(topic, g)
		_, err := p.t.admin.CreateSubscription(ctx, name, pubsub.SubscriptionConfig{Topic: tp, EnableMessageOrdering: true})
		if err != nil && status.Code(err) != codes.AlreadyExists {
			return fmt.Errorf("googlecloud: creating subscription %s: %w", name, err)
		}
	}
	p.declared[topic] = true
	return nil
}
