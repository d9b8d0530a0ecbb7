package keyed

import "context"

// WithClosing returns a copy of ctx that is also cancelled once closing is
// closed: how a key-parallel subscriber's Close ends the consumers its
// Subscribe calls started (transport/kafka and transport/amqp). Calling
// cancel, which the consumer does when it ends, releases the goroutine
// that watches closing.
func WithClosing(ctx context.Context, closing <-chan struct{}) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}
