package dlqtest_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/millwright/millwright/dlq/dlqtest"
)

// A transport's own test checks that a poison message does not block the
// messages behind it: it lands on "<topic>.dlq" after PoisonAttempts
// attempts. Write it in a _test.go file of yours, with your transport's
// publisher and subscriber (here Watermill's in-process one); `go test`
// runs it. (An example cannot run it: it needs the test's *testing.T.)
func ExampleTestPoisonDoesNotBlock() {
	_ = func(t *testing.T) { // func TestPoison(t *testing.T) in your package
		ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
		t.Cleanup(func() { _ = ps.Close() })
		dlqtest.TestPoisonDoesNotBlock(t, ps, ps, "orders")
	}
}

// The same check, run here as a test: it proves the example's code works.
func TestExampleTestPoisonDoesNotBlock(t *testing.T) {
	t.Parallel()
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	dlqtest.TestPoisonDoesNotBlock(t, ps, ps, "orders")
}
