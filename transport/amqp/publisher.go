package amqp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/millwright/millwright/internal/redact"
)

// Errors a publish can wrap; test them with errors.Is. Their texts have no
// "amqp:" prefix because they only appear wrapped in an error that has.
var (
	// ErrNotConnected is returned by Publish when the publisher's
	// connection is down (the publisher reconnects in the background;
	// retry later), and when the connection is lost before the broker
	// confirmed a message, which may or may not then have been stored.
	ErrNotConnected = errors.New("not connected to RabbitMQ")
	// ErrUnroutable is returned by Publish (unless Config.AllowUnroutable)
	// for a message the broker returned because no queue is bound to the
	// topic's exchange: nothing would have received it.
	ErrUnroutable = errors.New("message unroutable")
	// ErrNacked is returned by Publish when the broker refused a message
	// (basic.nack), for example because a bound queue with
	// x-overflow=reject-publish is full.
	ErrNacked = errors.New("broker refused the message (nack)")
	// ErrNotSent is wrapped in PublishBatch's *transport.BatchError for a
	// message it did not send because an earlier message with the same
	// metadata.OrderingKey failed (the error names it), or because the
	// channel was lost or the message's context was done before its turn
	// (the error wraps that cause too). The broker has certainly not
	// stored it: publish it again after the one that failed.
	ErrNotSent = errors.New("not sent")
	// ErrClosed is returned by Publish after Transport.Close.
	ErrClosed = errors.New("publisher is closed")
)

// Reconnect backoff: the first attempt right after a drop (the broker is
// often still there, as after rabbitmqctl close_all_connections), then
// doubling from minBackoff up to maxBackoff, each with ±20% jitter so that
// many processes cut at once do not reconnect in lockstep.
const (
	minBackoff = 100 * time.Millisecond
	maxBackoff = 5 * time.Second
)

// returnBuffer is the capacity of each channel's NotifyReturn buffer.
// amqp091 delivers a return from the connection's one reader goroutine
// with a blocking send, so a publish gathers returns all the while it
// waits for confirms (returnCollector), and the buffer only absorbs
// bursts.
const returnBuffer = 64

// publisher is millwright's AMQP publisher: one connection of its own,
// reconnected in the background, and a fixed pool of confirm-mode channels.
//
// The pool holds slots, not channels: a Publish takes a slot (bounded by
// ConnectTimeout and msg.Context()), makes sure the slot has a usable
// channel on the current connection (opening one if the slot's is missing,
// broken or from an older connection), and always puts the slot back. A
// failure can therefore cost a channel, which is closed and replaced on
// next use, but never a slot, so the pool keeps its size through any
// number of outages.
type publisher struct {
	cfg     Config
	amqpCfg amqp091.Config // without Dial: dial sets it per attempt
	wcfg    wamqp.Config   // what topology declares with
	builder wamqp.TopologyBuilder
	logger  watermill.LoggerAdapter
	host    string // the URL without password, for errors

	slots chan *slot

	mu       sync.Mutex
	conn     *amqp091.Connection // nil while down
	gen      uint64              // incremented for each new connection
	downErr  error               // why conn is nil
	declared map[string]struct{} // topics declared on conn
	changed  chan struct{}       // closed and replaced when conn comes or goes
	closed   bool

	inflight   sync.WaitGroup // Publish calls that passed enter
	closing    chan struct{}  // closed by Close
	life       context.Context
	cancelLife context.CancelFunc // aborts a dial in progress
	loopDone   chan struct{}

	batchStats
}

// slot is one place in the pool. Only the Publish holding it touches it.
type slot struct {
	ch      *amqp091.Channel // nil: open one on next use
	gen     uint64           // the connection ch belongs to
	closes  chan *amqp091.Error
	returns chan amqp091.Return // nil with AllowUnroutable
	// reason is why the broker closed ch, once read from closes (one
	// value is sent): kept past discard, so that every message of the
	// call in flight on the channel is judged by it.
	reason *amqp091.Error
}

// newPublisher connects within timeout (and ctx) and starts the
// reconnect loop.
func newPublisher(ctx context.Context, cfg Config, ac amqp091.Config, wcfg wamqp.Config, builder wamqp.TopologyBuilder, logger watermill.LoggerAdapter, timeout time.Duration) (*publisher, error) {
	life, cancel := context.WithCancel(context.Background())
	p := &publisher{
		cfg: cfg, amqpCfg: ac, wcfg: wcfg, builder: builder, logger: logger,
		host:    redact.URL(cfg.URL),
		slots:   make(chan *slot, cfg.ChannelPoolSize),
		changed: make(chan struct{}),
		closing: make(chan struct{}), life: life, cancelLife: cancel,
		loopDone: make(chan struct{}),
	}
	for range cfg.ChannelPoolSize {
		p.slots <- &slot{}
	}
	dctx, stop := context.WithCancel(ctx)
	defer stop()
	conn, closes, err := p.dial(dctx, timeout)
	if err != nil {
		cancel()
		return nil, err
	}
	p.setUp(conn)
	go p.run(conn, closes)
	return p, nil
}

// dial opens a connection within timeout, aborted when ctx is done, and
// registers for its close before anyone can use it.
func (p *publisher) dial(ctx context.Context, timeout time.Duration) (*amqp091.Connection, chan *amqp091.Error, error) {
	conn, err := dialAMQP(ctx, p.cfg.URL, p.amqpCfg, timeout)
	if err != nil {
		return nil, nil, err
	}
	return conn, conn.NotifyClose(make(chan *amqp091.Error, 1)), nil
}

// dialAMQP opens a connection to url within timeout, aborted when ctx is
// done. Its error has the URL's password redacted.
func dialAMQP(ctx context.Context, url string, ac amqp091.Config, timeout time.Duration) (*amqp091.Connection, error) {
	var stop func() bool
	ac.Dial = func(network, addr string) (net.Conn, error) {
		d := net.Dialer{Timeout: timeout}
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		// As amqp091.DefaultDial: bound the TLS and AMQP handshakes
		// (amqp091 clears the deadline once open); and abort them on
		// ctx, which DialConfig itself does not take.
		if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
			_ = c.Close()
			return nil, err
		}
		stop = context.AfterFunc(ctx, func() { _ = c.Close() })
		return c, nil
	}
	conn, err := amqp091.DialConfig(url, ac)
	if stop != nil {
		stop()
	}
	if err != nil {
		return nil, redact.ErrorOf(err, url)
	}
	return conn, nil
}

// setUp makes conn the current connection.
func (p *publisher) setUp(conn *amqp091.Connection) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conn, p.downErr = conn, nil
	p.gen++
	p.declared = map[string]struct{}{}
	close(p.changed)
	p.changed = make(chan struct{})
}

// setDown records that conn is gone, and why.
func (p *publisher) setDown(conn *amqp091.Connection, why error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn != conn {
		return
	}
	p.conn, p.downErr, p.declared = nil, why, nil
	close(p.changed)
	p.changed = make(chan struct{})
}

// run watches the connection and reconnects after it drops, until Close.
func (p *publisher) run(conn *amqp091.Connection, closes chan *amqp091.Error) {
	defer close(p.loopDone)
	for {
		select {
		case <-p.closing:
			return
		case e := <-closes:
			why := error(errors.New("connection closed"))
			if e != nil {
				why = e
			}
			p.setDown(conn, why)
			p.logger.Error("AMQP publisher connection lost, reconnecting", why, watermill.LogFields{"amqp_host": p.host})
		}
		if conn, closes = p.reconnect(); conn == nil {
			return // closing
		}
	}
}

// reconnect dials with backoff until it connects (returning the new
// connection, already current) or Close is called (returning nil).
func (p *publisher) reconnect() (*amqp091.Connection, chan *amqp091.Error) {
	var delay time.Duration
	for attempt := 1; ; attempt++ {
		if delay > 0 {
			jittered := time.Duration(float64(delay) * (0.8 + 0.4*rand.Float64()))
			timer := time.NewTimer(jittered)
			select {
			case <-p.closing:
				timer.Stop()
				return nil, nil
			case <-timer.C:
			}
		}
		conn, closes, err := p.dial(p.life, p.cfg.ConnectTimeout)
		if err == nil {
			p.mu.Lock()
			closed := p.closed
			p.mu.Unlock()
			if closed {
				_ = conn.CloseDeadline(time.Now().Add(p.cfg.ConnectTimeout))
				return nil, nil
			}
			p.setUp(conn)
			p.logger.Info("AMQP publisher reconnected", watermill.LogFields{"amqp_host": p.host, "attempts": attempt})
			return conn, closes
		}
		select {
		case <-p.closing:
			return nil, nil
		default:
		}
		p.mu.Lock()
		p.downErr = err
		p.mu.Unlock()
		p.logger.Error("AMQP publisher cannot reconnect, retrying", err, watermill.LogFields{"amqp_host": p.host, "attempt": attempt})
		delay = min(max(2*delay, minBackoff), maxBackoff)
	}
}

// enter registers a Publish with Close, or reports that Close has begun.
func (p *publisher) enter() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.inflight.Add(1)
	return true
}

// Publish publishes msgs to topic's exchange and, with confirms (the
// default), returns nil only when the broker confirmed every one. It is
// safe for concurrent use; each call holds one pooled channel. As in
// PublishBatch, messages of different ordering keys (and those without a
// key) are in flight together, each key's one at a time, and a key stops
// at its first failure: the error then wraps ErrNotSent for its later
// messages, which the broker does not have, so that publishing the call
// again keeps each key in order for a consumer that drops duplicates.
func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	if !p.enter() {
		return fmt.Errorf("amqp: publishing to %q: %w", topic, ErrClosed)
	}
	defer p.inflight.Done()

	// Marshal first, so that a bad message publishes nothing.
	pubs := make([]amqp091.Publishing, len(msgs))
	for i, msg := range msgs {
		pub, err := Marshaler{}.Marshal(msg)
		if err != nil {
			return fmt.Errorf("amqp: marshaling message %s for %q: %w", msg.UUID, topic, err)
		}
		pubs[i] = pub
	}

	s, err := p.acquire(msgs[0].Context(), topic)
	if err != nil {
		return err
	}
	defer func() { p.slots <- s }() // never blocks: one place per slot
	conn, err := p.prepare(s, topic)
	if err != nil {
		return err
	}
	idx := make([]int, len(msgs))
	for i := range idx {
		idx[i] = i
	}
	failed := p.sendPrepared(conn, s, topic, msgs, pubs, idx)
	switch len(failed) {
	case 0:
		return nil
	case 1:
		for _, err := range failed {
			return err
		}
	}
	errs := make([]error, 0, len(failed))
	for i := range msgs {
		if err, ok := failed[i]; ok {
			errs = append(errs, err)
		}
	}
	return fmt.Errorf("amqp: %d of %d messages to exchange %q not published: %w", len(errs), len(msgs), topic, errors.Join(errs...))
}

// acquire takes a slot from the pool, waiting at most ConnectTimeout.
func (p *publisher) acquire(ctx context.Context, topic string) (*slot, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("amqp: publishing to %q: %w", topic, err)
	}
	select {
	case s := <-p.slots:
		return s, nil
	default:
	}
	timer := time.NewTimer(p.cfg.ConnectTimeout)
	defer timer.Stop()
	select {
	case s := <-p.slots:
		return s, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("amqp: publishing to %q: waiting for a free channel: %w", topic, ctx.Err())
	case <-p.closing:
		return nil, fmt.Errorf("amqp: publishing to %q: %w", topic, ErrClosed)
	case <-timer.C:
		return nil, fmt.Errorf("amqp: publishing to %q: all %d channels stayed busy for %s: raise ChannelPoolSize or ConnectTimeout, or publish less concurrently",
			topic, cap(p.slots), p.cfg.ConnectTimeout)
	}
}

// prepare gives s an open channel on the current connection, which it
// returns, and declares topic's exchange on it once per connection.
func (p *publisher) prepare(s *slot, topic string) (*amqp091.Connection, error) {
	p.mu.Lock()
	conn, gen, downErr := p.conn, p.gen, p.downErr
	_, declared := p.declared[topic]
	p.mu.Unlock()
	if conn == nil {
		s.discard()
		return nil, fmt.Errorf("amqp: publishing to %q: %w: connection to %s is down (%v); reconnecting in the background, retry later",
			topic, ErrNotConnected, p.host, downErr)
	}
	if s.ch != nil && (s.gen != gen || s.ch.IsClosed()) {
		s.discard()
	}
	if s.ch == nil {
		if err := s.open(conn, gen, !p.cfg.NoConfirm, !p.cfg.AllowUnroutable); err != nil {
			return nil, p.lost(conn, fmt.Sprintf("publishing to %q: opening a channel", topic), err)
		}
	}
	if declared {
		return conn, nil
	}
	if err := p.builder.ExchangeDeclare(s.ch, topic, p.wcfg); err != nil {
		s.discard() // the broker closes a channel whose declaration failed
		return nil, p.lost(conn, fmt.Sprintf("declaring exchange %q", topic), err)
	}
	p.mu.Lock()
	if p.gen == gen && p.declared != nil {
		p.declared[topic] = struct{}{}
	}
	p.mu.Unlock()
	return conn, nil
}

// lost wraps err, adding ErrNotConnected when conn has gone. A failed
// write or read means it has, even before amqp091 (which shuts the
// connection down asynchronously after an I/O error) marks it closed.
func (p *publisher) lost(conn *amqp091.Connection, what string, err error) error {
	var opErr *net.OpError
	if conn.IsClosed() || errors.As(err, &opErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("amqp: %s: %w: connection to %s lost (%v)", what, ErrNotConnected, p.host, err)
	}
	return fmt.Errorf("amqp: %s: %w", what, err)
}

// forget makes the next publish to topic declare its exchange again.
func (p *publisher) forget(topic string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.declared, topic)
}

// open opens a channel on conn, in confirm mode unless !confirm.
func (s *slot) open(conn *amqp091.Connection, gen uint64, confirm, mandatory bool) error {
	s.reason = nil
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	closes := ch.NotifyClose(make(chan *amqp091.Error, 1))
	var returns chan amqp091.Return
	if mandatory {
		returns = ch.NotifyReturn(make(chan amqp091.Return, returnBuffer))
	}
	if confirm {
		if err := ch.Confirm(false); err != nil {
			_ = ch.Close()
			return err
		}
	}
	s.ch, s.gen, s.closes, s.returns = ch, gen, closes, returns
	return nil
}

// discard closes the slot's channel, if any; the next use opens another.
func (s *slot) discard() {
	s.closeReason() // keep it: the closes channel goes with the slot's channel
	if ch := s.ch; ch != nil {
		// Close waits for the broker's close-ok with no bound; a broker
		// that stopped answering (a memory alarm, a hung connection) would
		// hold the publish whose confirm was just abandoned. The channel is
		// no longer used: close it aside. It returns at once when the
		// channel or connection is already gone, and when the connection
		// dies at the latest.
		go func() { _ = ch.Close() }()
	}
	s.ch, s.closes, s.returns = nil, nil, nil
}

// closeReason is why the broker closed the channel, if it said.
func (s *slot) closeReason() *amqp091.Error {
	if s.reason != nil || s.closes == nil {
		return s.reason
	}
	select {
	case e := <-s.closes:
		s.reason = e
	default:
	}
	return s.reason
}

func reasonErr(e *amqp091.Error) error {
	if e == nil {
		return amqp091.ErrClosed
	}
	return e
}

// unroutableErr is the error of message id, which the broker returned.
func unroutableErr(id string, r amqp091.Return) error {
	return fmt.Errorf("amqp: message %s: no queue is bound to exchange %q: nothing would receive the message (broker returned it: %d %s); subscribe a group (or list it in Config.DeclareGroups, env MILLWRIGHT_DECLARE_GROUPS) before publishing, or set AllowUnroutable (env MILLWRIGHT_AMQP_ALLOW_UNROUTABLE) to let RabbitMQ drop such messages: %w",
		id, r.Exchange, r.ReplyCode, r.ReplyText, ErrUnroutable)
}

// Close stops reconnecting, waits up to ConnectTimeout for the publishes
// in flight, then closes the connection (failing any still waiting). It
// is idempotent and safe to call concurrently with Publish.
func (p *publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true // no enter() succeeds from here: inflight only shrinks
	p.mu.Unlock()
	close(p.closing)

	var errs []error
	drained := make(chan struct{})
	go func() {
		p.inflight.Wait()
		close(drained)
	}()
	timer := time.NewTimer(p.cfg.ConnectTimeout)
	select {
	case <-drained:
	case <-timer.C:
		errs = append(errs, fmt.Errorf("amqp: closing publisher: publishes still waiting for the broker after %s; closing the connection under them", p.cfg.ConnectTimeout))
	}
	timer.Stop()
	p.cancelLife()
	<-p.loopDone

	p.mu.Lock()
	conn := p.conn
	p.conn, p.downErr, p.declared = nil, ErrClosed, nil
	close(p.changed)
	p.changed = make(chan struct{})
	p.mu.Unlock()
	if conn != nil {
		if err := conn.CloseDeadline(time.Now().Add(p.cfg.ConnectTimeout)); err != nil && !errors.Is(err, amqp091.ErrClosed) {
			errs = append(errs, fmt.Errorf("amqp: closing publisher connection: %w", err))
		}
	}
	return errors.Join(errs...)
}

// state reports whether the publisher is connected, and a channel closed
// at its next change: for tests that wait for a drop or a reconnect.
func (p *publisher) state() (bool, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conn != nil, p.changed
}
