package retry_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/retry"
)

func ExampleDo() {
	policy := retry.Policy{InitialInterval: time.Millisecond, MaxAttempts: 5}
	err := retry.Do(context.Background(), policy, func(ctx context.Context) error {
		if n := retry.Attempt(ctx); n < 3 {
			fmt.Println("attempt", n, "failed")
			return errors.New("connection refused")
		}
		fmt.Println("attempt", retry.Attempt(ctx), "succeeded")
		return nil
	})
	fmt.Println("err:", err)
	// Output:
	// attempt 1 failed
	// attempt 2 failed
	// attempt 3 succeeded
	// err: <nil>
}

// A permanent error (package failure) stops the retries at once.
func Example_permanent() {
	rm, _ := retry.NewMiddleware(retry.Config{Policy: retry.Policy{InitialInterval: time.Millisecond}})
	handler := rm.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("attempt", retry.Attempt(msg.Context()))
		return nil, failure.Permanent(fmt.Errorf("order %s: unknown currency %q", msg.UUID, "XXX"))
	})
	_, err := handler(message.NewMessage("order-1", nil))
	var re *retry.Error
	errors.As(err, &re)
	fmt.Println("permanent:", failure.IsPermanent(err), "attempts:", re.Attempts)
	fmt.Println(err)
	// Output:
	// attempt 1
	// permanent: true attempts: 1
	// order order-1: unknown currency "XXX" (after 1 attempts)
}
