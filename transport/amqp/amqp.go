package amqp

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/closers"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
)

// Config is transport.AMQPConfig: the settings live in package transport, so that
// a program links only the kinds it imports.
type Config = transport.AMQPConfig

func setDefaults(c *Config) {
	if c.Prefetch == 0 {
		c.Prefetch = max(100, 16*c.KeyParallelism)
	}
	if c.KeyDrainTimeout == 0 {
		c.KeyDrainTimeout = 30 * time.Second
	}
	if c.ChannelPoolSize == 0 {
		c.ChannelPoolSize = 8
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 10 * time.Second
	}
}

// Validate reports configuration that cannot work, naming the field.
func validate(c Config) error {
	var errs []error
	if c.URL == "" {
		errs = append(errs, errors.New("amqp: URL is empty: set amqp://user:pass@host:5672/vhost (env MILLWRIGHT_AMQP_URL)"))
	} else if u, err := url.Parse(c.URL); err != nil {
		errs = append(errs, fmt.Errorf("amqp: URL is malformed: %v", redact.ErrorOf(err, c.URL)))
	} else if u.Scheme != "amqp" && u.Scheme != "amqps" {
		errs = append(errs, fmt.Errorf("amqp: URL scheme %q: want amqp or amqps", u.Scheme))
	} else if u.Host == "" {
		errs = append(errs, errors.New("amqp: URL has no host: want amqp://user:pass@host:5672/vhost"))
	}
	if c.Prefetch < 0 {
		errs = append(errs, fmt.Errorf("amqp: Prefetch %d is negative", c.Prefetch))
	}
	errs = append(errs, validateKeyed(c)...)
	if c.ChannelPoolSize < 0 {
		errs = append(errs, fmt.Errorf("amqp: ChannelPoolSize %d is negative", c.ChannelPoolSize))
	}
	if c.ConnectTimeout < 0 {
		errs = append(errs, fmt.Errorf("amqp: ConnectTimeout %s is negative", c.ConnectTimeout))
	}
	if c.NoConfirm && !c.AllowUnroutable {
		errs = append(errs, errors.New("amqp: NoConfirm needs AllowUnroutable: without publisher confirms a message no queue is bound for cannot be detected (its return is only known to be a publish's own when that publish's confirm follows it); unset NoConfirm, or also set AllowUnroutable (env MILLWRIGHT_AMQP_ALLOW_UNROUTABLE=true) to accept that such messages are dropped"))
	}
	for _, g := range c.DeclareGroups {
		if g == "" {
			errs = append(errs, errors.New("amqp: DeclareGroups has an empty group name"))
		}
	}
	return errors.Join(errs...)
}

// validateKeyed checks the key-parallel consumer's settings.
func validateKeyed(c Config) []error {
	var errs []error
	if c.KeyParallelism < 0 {
		errs = append(errs, fmt.Errorf("amqp: KeyParallelism %d is negative: want 0 (off: watermill-amqp's subscriber, one delivery at a time) or the keys handled at once per subscription (env MILLWRIGHT_AMQP_KEY_PARALLELISM)", c.KeyParallelism))
	}
	if c.KeyParallelism > 0 && c.Prefetch > 0 && c.Prefetch < c.KeyParallelism {
		errs = append(errs, fmt.Errorf("amqp: Prefetch %d is below KeyParallelism %d: the broker would never send enough deliveries to run that many keys at once; raise Prefetch (env MILLWRIGHT_AMQP_PREFETCH; unset, it defaults to 16 x KeyParallelism) or lower KeyParallelism", c.Prefetch, c.KeyParallelism))
	}
	if c.Prefetch > 65535 {
		errs = append(errs, fmt.Errorf("amqp: Prefetch %d is above 65535, the largest prefetch count AMQP 0-9-1 can carry", c.Prefetch))
	}
	if c.KeyDrainTimeout < 0 {
		errs = append(errs, fmt.Errorf("amqp: KeyDrainTimeout %s is negative: want 0 (default 30s) or how long Close waits for running handlers", c.KeyDrainTimeout))
	}
	return errs
}

// Transport holds two connections to RabbitMQ: the publisher's own, and
// one its subscribers share (opened by the first Subscriber call). Apart,
// a broker's flow control on publishing cannot stall consumption, and
// each reconnects on its own.
type Transport struct {
	cfg     Config
	urlFrom string // where URL came from (transport.Config.Setting)
	logger  watermill.LoggerAdapter
	amqpCfg amqp091.Config
	pub     *publisher

	mu   sync.Mutex
	conn *wamqp.ConnectionWrapper // the subscribers'; nil until the first

	subs closers.Set
}

// Open connects the publisher within ConnectTimeout (or ctx's deadline, if
// sooner). It makes one attempt: transport.Open is what waits for a broker
// that is down (transport.Config.WaitForBroker). An error that waiting
// cannot fix (configuration, credentials or vhost refused, TLS against a
// plaintext port) is marked failure.Permanent. Errors name the URL as
// amqp.Config.URL.
func Open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (*Transport, error) {
	return open(ctx, cfg, logger, "amqp.Config.URL")
}

// open is Open naming urlFrom (transport.Config.Setting) as the URL's
// source in its errors.
func open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter, urlFrom string) (*Transport, error) {
	setDefaults(&cfg)
	if err := validate(cfg); err != nil {
		return nil, failure.Permanent(err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	timeout := cfg.ConnectTimeout
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < timeout {
		timeout = time.Until(dl)
	}
	ac := amqp091.Config{
		TLSClientConfig: cfg.TLS,
		Heartbeat:       10 * time.Second,
		Locale:          "en_US",
	}
	t := &Transport{cfg: cfg, urlFrom: urlFrom, logger: logger, amqpCfg: ac}
	pc := t.config("")
	var builder wamqp.TopologyBuilder = &wamqp.DefaultTopologyBuilder{}
	if len(cfg.DeclareGroups) > 0 {
		builder = &declaringBuilder{groups: cfg.DeclareGroups}
	}
	pubCfg := ac
	pubCfg.Properties = amqp091.NewConnectionProperties()
	pubCfg.Properties.SetClientConnectionName("millwright publisher")
	pub, err := newPublisher(ctx, cfg, pubCfg, pc, builder, logger, timeout)
	if err != nil {
		return nil, connectError(cfg.URL, urlFrom, err)
	}
	t.pub = pub
	return t, nil
}

// subscriberConn returns the subscribers' connection, opening it the
// first time within ConnectTimeout.
func (t *Transport) subscriberConn() (*wamqp.ConnectionWrapper, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.conn != nil {
		return t.conn, nil
	}
	ac := t.amqpCfg
	ac.Dial = amqp091.DefaultDial(t.cfg.ConnectTimeout)
	ac.Properties = amqp091.NewConnectionProperties()
	ac.Properties.SetClientConnectionName("millwright subscribers")
	conn, err := wamqp.NewConnection(wamqp.ConnectionConfig{AmqpURI: t.cfg.URL, AmqpConfig: &ac}, t.logger)
	if err != nil {
		return nil, connectError(t.cfg.URL, t.urlFrom, redact.ErrorOf(err, t.cfg.URL))
	}
	t.conn = conn
	return conn, nil
}

func (t *Transport) closeSubscriberConn() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.conn == nil {
		return nil
	}
	return t.conn.Close()
}

// QueueName is the durable queue of a consumer group on a topic.
func QueueName(topic, group string) string {
	if group == "" {
		return topic
	}
	return topic + "_" + group
}

// DeleteTopology deletes, at url, the queue (QueueName) of each group on
// each topic and then the topic's exchange: for tests and benchmarks that
// must leave a shared broker as they found it. Each deletion gets its own
// channel (a failed one closes its channel), and every failure is returned,
// joined; deleting what does not exist is not one.
func DeleteTopology(url string, topics []string, groups ...string) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return fmt.Errorf("amqp: dial: %w", err)
	}
	defer conn.Close()
	var errs []error
	do := func(what string, f func(ch *amqp091.Channel) error) {
		ch, err := conn.Channel()
		if err == nil {
			err = f(ch)
			_ = ch.Close()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("amqp: deleting %s: %w", what, err))
		}
	}
	for _, topic := range topics {
		for _, g := range groups {
			q := QueueName(topic, g)
			do("queue "+q, func(ch *amqp091.Channel) error { _, err := ch.QueueDelete(q, false, false, false); return err })
		}
		do("exchange "+topic, func(ch *amqp091.Channel) error { return ch.ExchangeDelete(topic, false, false) })
	}
	return errors.Join(errs...)
}

func (t *Transport) config(group string) wamqp.Config {
	c := wamqp.NewDurablePubSubConfig(t.cfg.URL, func(topic string) string { return QueueName(topic, group) })
	c.Consume.Qos.PrefetchCount = t.cfg.Prefetch
	c.Marshaler = Marshaler{}
	return c
}

// Marshaler is watermill-amqp's default marshaler (persistent messages,
// metadata as headers) plus the CloudEvents AMQP binding in binary mode:
// attributes travel as application properties (headers) named
// "cloudEvents:<attr>", and datacontenttype as the message's content-type
// property. Unmarshal maps them back to the metadata.Event* keys, accepts
// the "cloudEvents_" prefix of earlier drafts, and turns the binding's
// native AMQP values (timestamp, integers, booleans) into their canonical
// strings, as the binding requires receivers to. Marshal also sets the
// message-id property to the event id (metadata.EventID, else the message
// UUID) and timestamp to the event time (metadata.EventTime, else the
// publish time).
type Marshaler struct{ wamqp.DefaultMarshaler }

// Marshal implements wamqp.Marshaler.
func (m Marshaler) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	p, err := m.DefaultMarshaler.Marshal(msg)
	if err != nil {
		return p, err
	}
	for k, v := range msg.Metadata {
		w := cloudevent.AMQP.WireKey(k)
		switch {
		case w == k:
			continue
		case w == "": // datacontenttype: the content-type property
			p.ContentType = v
		default:
			p.Headers[w] = v
		}
		delete(p.Headers, k)
	}
	// The AMQP properties readers look at before any header: the event id
	// as message-id (the Watermill UUID when there is none), and the event
	// time, or now, as timestamp (whole seconds on the wire).
	p.MessageId = msg.Metadata.Get(metadata.EventID)
	if p.MessageId == "" {
		p.MessageId = msg.UUID
	}
	p.Timestamp = time.Now()
	if t, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(metadata.EventTime)); err == nil {
		p.Timestamp = t
	}
	return p, nil
}

// Unmarshal implements wamqp.Marshaler.
func (m Marshaler) Unmarshal(d amqp091.Delivery) (*message.Message, error) {
	headers := make(amqp091.Table, len(d.Headers))
	for k, v := range d.Headers {
		if mk := cloudevent.AMQP.MetadataKey(k); mk != k {
			s, err := canonicalString(v)
			if err != nil {
				return nil, fmt.Errorf("amqp: message %s: application property %s: %w", d.MessageId, k, err)
			}
			headers[k] = s
			continue
		}
		headers[k] = v
	}
	d.Headers = headers
	msg, err := m.DefaultMarshaler.Unmarshal(d)
	if err != nil {
		return nil, err
	}
	cloudevent.AMQP.Decode(msg.Metadata)
	if d.ContentType != "" {
		msg.Metadata.Set(metadata.EventDataContentType, d.ContentType)
	}
	return msg, nil
}

// canonicalString renders an AMQP value of a CloudEvents attribute as the
// attribute's canonical string (CloudEvents type system).
func canonicalString(v any) (string, error) {
	switch x := v.(type) {
	case string:
		return x, nil
	case time.Time:
		return x.UTC().Format(time.RFC3339Nano), nil
	case bool:
		return strconv.FormatBool(x), nil
	case int8, int16, int32, int64, int, uint8, uint16, uint32, uint64:
		return fmt.Sprint(x), nil
	case []byte:
		return base64.StdEncoding.EncodeToString(x), nil
	default:
		return "", fmt.Errorf("value of type %T is not a CloudEvents type (want string, timestamp, integer, boolean or binary)", v)
	}
}

// Publisher returns the transport's publisher, safe for concurrent use.
// See the package documentation for its guarantees.
func (t *Transport) Publisher() message.Publisher { return t.pub }

// Subscriber returns a subscriber reading the group's durable queue of each
// topic it subscribes to. Group "" uses a queue named after the topic.
//
// With Config.KeyParallelism above 0 the subscriber is a KeyedSubscriber:
// keys in parallel, each delivery acked once its handler finished.
func (t *Transport) Subscriber(group string) (message.Subscriber, error) {
	if t.cfg.KeyParallelism > 0 {
		sub, err := closers.Add(&t.subs, "amqp", func() (*KeyedSubscriber, error) { return newKeyedSubscriber(t, group), nil })
		if err != nil {
			return nil, err
		}
		return sub, nil
	}
	sub, err := closers.Add(&t.subs, "amqp", func() (*wamqp.Subscriber, error) {
		conn, err := t.subscriberConn()
		if err != nil {
			return nil, err
		}
		sub, err := wamqp.NewSubscriberWithConnection(t.config(group), t.logger, conn)
		if err != nil {
			return nil, fmt.Errorf("amqp: creating subscriber for group %q: %w", group, redact.ErrorOf(err, t.cfg.URL))
		}
		return sub, nil
	})
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return sub, nil
}

// Close closes the subscribers, the publisher (waiting up to
// ConnectTimeout for its publishes in flight), then the subscribers'
// connection. It is idempotent.
func (t *Transport) Close() error {
	return t.subs.Close(t.pub.Close, t.closeSubscriberConn)
}

// declaringBuilder declares, with each topic's exchange, the durable queues
// of the configured groups, so a publish before their subscribers start is
// kept rather than dropped by the fanout exchange.
type declaringBuilder struct {
	wamqp.DefaultTopologyBuilder
	groups []string
}

func (b *declaringBuilder) ExchangeDeclare(ch *amqp091.Channel, exchange string, c wamqp.Config) error {
	if err := b.DefaultTopologyBuilder.ExchangeDeclare(ch, exchange, c); err != nil {
		return err
	}
	for _, g := range b.groups {
		q := QueueName(exchange, g)
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			return fmt.Errorf("amqp: declaring queue %s: %w", q, err)
		}
		if err := ch.QueueBind(q, "", exchange, false, nil); err != nil {
			return fmt.Errorf("amqp: binding queue %s to %s: %w", q, exchange, err)
		}
	}
	return nil
}
