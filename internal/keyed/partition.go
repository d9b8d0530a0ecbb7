package keyed

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Config tunes one Partition.
type Config struct {
	// Concurrency is how many keys' messages run at once. Default 16;
	// 1 gives one message at a time, in stream order.
	Concurrency int
	// MaxInFlight bounds the messages submitted and not finished (running
	// or waiting behind their key or for a free slot); finished messages
	// above the watermark are not counted (nor kept). Default
	// 16 × Concurrency; must be at least Concurrency.
	MaxInFlight int
	// RetryDelay is the pause before a message whose handler returned an
	// error runs again. Default 100 ms (watermill-kafka's NackResendSleep);
	// -1: none.
	RetryDelay time.Duration
}

func (c *Config) setDefaults() {
	if c.Concurrency == 0 {
		c.Concurrency = 16
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 16 * c.Concurrency
	}
	if c.RetryDelay == 0 {
		c.RetryDelay = 100 * time.Millisecond
	}
}

// Validate reports settings that cannot work.
func (c Config) Validate() error {
	var errs []error
	if c.Concurrency < 1 {
		errs = append(errs, fmt.Errorf("keyed: Concurrency %d: want 1 or more", c.Concurrency))
	}
	if c.MaxInFlight < c.Concurrency {
		errs = append(errs, fmt.Errorf("keyed: MaxInFlight %d is below Concurrency %d: want at least Concurrency (default 16 × Concurrency)", c.MaxInFlight, c.Concurrency))
	}
	if c.RetryDelay < -1 {
		errs = append(errs, fmt.Errorf("keyed: RetryDelay %s is negative: want a duration, or -1 for none", c.RetryDelay))
	}
	return errors.Join(errs...)
}

// ErrStopped is returned by Submit once Drain has begun.
var ErrStopped = errors.New("keyed: partition is draining")

// PanicError is a handler's panic, recovered by the partition: the
// message is run again after RetryDelay in its key's place, as for an
// error, and the stream goes on.
type PanicError struct {
	Value any    // what the handler panicked with
	Stack []byte // the panicking goroutine's stack
}

func (e *PanicError) Error() string { return fmt.Sprintf("keyed: handler panicked: %v", e.Value) }

// Handler handles one message. It returns nil when the message is finished
// (acked), an error to run it again after RetryDelay. ctx ends when the
// partition is drained past its bound; a handler should then return.
type Handler[T any] func(ctx context.Context, v T) error

// Partition runs one ordered stream; see the package doc. Submit must be
// called from one goroutine (the stream's reader); Watermark and Drain are
// safe for concurrent use.
type Partition[T any] struct {
	cfg     Config
	handle  Handler[T]
	commit  func(next int64)
	onPanic func(v T, err *PanicError)
	panics  atomic.Int64

	ctx    context.Context // the handlers'; cancelled by Drain's bound
	cancel context.CancelFunc
	slots  chan struct{} // one per message in flight
	stop   chan struct{} // closed when Drain begins

	mu       sync.Mutex
	wm       watermark
	keys     map[string]*keyQueue[T] // keys with messages in flight
	ready    []*keyQueue[T]          // keys waiting for a worker, FIFO
	running  int                     // workers
	stopping bool
	idle     chan struct{} // closed when stopping and running reaches 0
}

type item[T any] struct {
	offset int64
	v      T
}

type keyQueue[T any] struct {
	key   string
	items []item[T]
	// waiting: in ready, no worker on it, so items[0] is not running
	// (otherwise a worker runs items[0]).
	waiting bool
}

// NewPartition returns a partition that runs handle and calls commit with
// the watermark each time it advances. commit is called with the
// partition's lock held, in increasing order: it must be quick and must
// not call back into the partition (Sarama's MarkOffset is).
func NewPartition[T any](cfg Config, handle Handler[T], commit func(next int64)) (*Partition[T], error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if handle == nil || commit == nil {
		return nil, errors.New("keyed: NewPartition needs a handler and a commit function")
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Partition[T]{
		cfg: cfg, handle: handle, commit: commit,
		ctx: ctx, cancel: cancel,
		slots: make(chan struct{}, cfg.MaxInFlight),
		stop:  make(chan struct{}),
		keys:  map[string]*keyQueue[T]{},
		idle:  make(chan struct{}),
	}, nil
}

// OnPanic sets f to be called (from the handler's goroutine) with each
// message whose handler panicked, before it is run again: to log it with
// what identifies the message. Call it before the first Submit.
func (p *Partition[T]) OnPanic(f func(v T, err *PanicError)) { p.onPanic = f }

// Stopping is closed when Drain begins: a handler still waiting to hand
// its message on (it has not started it) should then give up, returning
// an error, rather than hold the drain until its bound.
func (p *Partition[T]) Stopping() <-chan struct{} { return p.stop }

// Panics counts the handler panics the partition recovered.
func (p *Partition[T]) Panics() int64 { return p.panics.Load() }

// call runs the handler, turning a panic into a *PanicError: one message
// must not end the process, nor the worker and the key it holds.
func (p *Partition[T]) call(v T) (err error) {
	defer func() {
		if r := recover(); r != nil {
			perr := &PanicError{Value: r, Stack: debug.Stack()}
			p.panics.Add(1)
			if p.onPanic != nil {
				p.onPanic(v, perr)
			}
			err = perr
		}
	}()
	return p.handle(p.ctx, v)
}

// Submit adds the stream's next message. It blocks while MaxInFlight
// messages are in flight, until ctx ends (returning its error) or Drain
// begins (ErrStopped). Offsets must increase from call to call.
func (p *Partition[T]) Submit(ctx context.Context, key string, offset int64, v T) error {
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	case <-p.stop:
		return ErrStopped
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping {
		<-p.slots
		return ErrStopped
	}
	if !p.wm.add(offset) {
		<-p.slots
		return fmt.Errorf("keyed: offset %d is not above the previous one: a partition's offsets must increase", offset)
	}
	if key == "" {
		key = "\x00" + strconv.FormatInt(offset, 10) // unkeyed: a key of its own
	}
	it := item[T]{offset: offset, v: v}
	if q := p.keys[key]; q != nil {
		q.items = append(q.items, it)
		return nil
	}
	q := &keyQueue[T]{key: key, items: []item[T]{it}}
	p.keys[key] = q
	if p.running < p.cfg.Concurrency {
		p.running++
		go p.work(q)
	} else {
		q.waiting = true
		p.ready = append(p.ready, q)
	}
	return nil
}

// work runs q's messages, then the keys waiting, until none is left.
func (p *Partition[T]) work(q *keyQueue[T]) {
	for q != nil {
		p.mu.Lock()
		it := q.items[0]
		p.mu.Unlock()
		if !p.run(it) {
			p.mu.Lock()
			p.exitLocked()
			p.mu.Unlock()
			return
		}
		q = p.finish(q, it)
	}
}

// run runs one message until it succeeds (true) or the partition's context
// ends (false: the message stays unfinished).
func (p *Partition[T]) run(it item[T]) bool {
	for {
		if p.ctx.Err() != nil {
			return false
		}
		if p.call(it.v) == nil {
			return true
		}
		if p.isStopping() {
			return false // the partition's next owner runs it again
		}
		if p.cfg.RetryDelay > 0 {
			t := time.NewTimer(p.cfg.RetryDelay)
			select {
			case <-t.C:
			case <-p.ctx.Done():
				t.Stop()
				return false
			}
		}
	}
}

// finish records it done and returns the queue the worker takes next
// (nil: the worker exits). Keys take turns: a key with more messages goes
// behind the keys already waiting.
func (p *Partition[T]) finish(q *keyQueue[T], it item[T]) *keyQueue[T] {
	p.mu.Lock()
	defer p.mu.Unlock()
	q.items[0] = item[T]{}
	q.items = q.items[1:]
	if p.wm.done(it.offset) && p.ctx.Err() == nil {
		next, _ := p.wm.value()
		p.commit(next)
	}
	<-p.slots
	if len(q.items) == 0 {
		delete(p.keys, q.key)
	} else {
		q.waiting = true
		p.ready = append(p.ready, q)
	}
	if p.stopping || len(p.ready) == 0 {
		p.exitLocked()
		return nil
	}
	next := p.ready[0]
	p.ready[0] = nil
	p.ready = p.ready[1:]
	next.waiting = false
	return next
}

// Discard drops the submitted messages that have not started and for
// which drop reports true: they give back their slots at once and count
// as finished for the watermark. A running message is never dropped. It
// is for a stream whose messages became void (an AMQP channel that
// closed: RabbitMQ has its unacked deliveries again), so that they do not
// hold their slots until their key's running message returns. It returns
// how many it dropped; it is safe for concurrent use.
func (p *Partition[T]) Discard(drop func(T) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	advanced := false
	for key, q := range p.keys {
		first := 1 // items[0] runs
		if q.waiting {
			first = 0
		}
		kept := q.items[:first]
		for _, it := range q.items[first:] {
			if !drop(it.v) {
				kept = append(kept, it)
				continue
			}
			n++
			<-p.slots
			if p.wm.done(it.offset) {
				advanced = true
			}
		}
		clear(q.items[len(kept):])
		q.items = kept
		if len(q.items) == 0 { // only a waiting key can empty
			delete(p.keys, key)
			p.ready = slices.DeleteFunc(p.ready, func(r *keyQueue[T]) bool { return r == q })
		}
	}
	if advanced && p.ctx.Err() == nil {
		next, _ := p.wm.value()
		p.commit(next)
	}
	return n
}

func (p *Partition[T]) isStopping() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopping
}

func (p *Partition[T]) exitLocked() {
	p.running--
	if p.stopping && p.running == 0 {
		close(p.idle)
	}
}

// Watermark returns the lowest offset not finished (everything below it
// is) and false when nothing was submitted yet.
func (p *Partition[T]) Watermark() (int64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.wm.value()
}

// Drain stops the partition: Submit refuses, no message starts, and Drain
// waits for the running handlers until ctx ends, then cancels their
// context and returns without waiting more. It returns the final
// watermark (commit is not called after Drain returns) and whether every
// running handler finished in time. Drain may be called once.
func (p *Partition[T]) Drain(ctx context.Context) (next int64, known, finished bool) {
	p.mu.Lock()
	p.stopping = true
	close(p.stop)
	if p.running == 0 {
		close(p.idle)
	}
	p.mu.Unlock()
	select {
	case <-p.idle:
		finished = true
	case <-ctx.Done():
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cancel() // under the lock: no commit after this
	next, known = p.wm.value()
	return next, known, finished
}
