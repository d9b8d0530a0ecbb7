package shutdown_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/millwright/millwright/shutdown"
)

// A service's main: every wait takes ctx, so SIGINT or SIGTERM ends it at
// once; a wait that cannot hear ctx is cut Grace after the signal.
func ExampleContext() {
	ctx, stop := shutdown.Context(context.Background(), "orders")
	defer stop()

	wctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	<-wctx.Done() // stands for a wait: a relay's Run, a router's Run
	fmt.Println("deadline passed:", shutdown.DeadlinePassed(wctx), "signalled:", ctx.Err() != nil)
	// Output: deadline passed: true signalled: false
}

// What a program made to exit prints on stderr.
func ExampleMessage() {
	fmt.Println(shutdown.Message("orders", errors.New("terminated signal received"), 750*time.Millisecond, nil))
	// Output: orders: terminated signal received; still waiting after 750ms for work that does not watch the signal (no Postgres call in flight); exiting
}

// A service's main: Service's grace (25 s unless configured) lets the
// handlers in flight finish after SIGTERM; the service then returns from
// main and exits 0.
func ExampleService() {
	ctx, stop, err := shutdown.Service(context.Background(), shutdown.Config{Name: "orders", Grace: 20 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	_ = ctx // router.Run(ctx), relay.Run(ctx): each drains when ctx ends
	fmt.Println("default grace:", shutdown.DefaultServiceGrace)
	// Output: default grace: 25s
}
