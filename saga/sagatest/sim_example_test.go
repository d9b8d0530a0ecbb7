package sagatest_test

import (
	"fmt"
	"time"

	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
)

// A saga tested with no database and no broker: the payment step never
// answers, so it times out and the saga compensates, then its success
// arrives late and is undone too.
func ExampleSimulator() {
	type order struct{ ID string }
	cmd := func(typ string) func(order) (saga.Command, error) {
		return func(o order) (saga.Command, error) {
			return saga.Command{Topic: "commands", Type: typ, Payload: o}, nil
		}
	}
	def := saga.MustDefine("orders",
		saga.Step[order]{Name: "reserve", Command: cmd("reserve"), Compensation: cmd("release")},
		saga.Step[order]{Name: "charge", Command: cmd("charge"), Compensation: cmd("refund"), Timeout: 30 * time.Second},
		saga.Step[order]{Name: "ship", Command: cmd("ship"), NoCompensation: true},
	)
	sim, _ := sagatest.NewSimulator(def)
	_ = sim.OnStep("charge", sagatest.Silent)

	_ = sim.Start("o-1", order{ID: "o-1"})
	_ = sim.RunUntilIdle() // replies, and the clock to each deadline
	fmt.Println(sim.State("o-1"), sim.Now().Sub(sagatest.SimEpoch))

	_ = sim.Succeed("o-1", "charge") // the payment went through after all
	fmt.Println(sim.State("o-1"))
	_ = sim.RunUntilIdle()
	fmt.Println(sim.State("o-1"))
	for _, c := range sim.Sent("o-1") {
		fmt.Println(c, c.Type)
	}
	// Output:
	// compensated 30s
	// compensating
	// compensated
	// reserve/forward/1 reserve
	// charge/forward/1 charge
	// charge/compensation/1 refund
	// reserve/compensation/1 release
	// charge/compensation/2 refund
}

// A saga that waits for a manager's approval: the event comes in time
// for one order, too late for the other.
func ExampleSimulator_Signal() {
	type order struct{ ID string }
	cmd := func(typ string) func(order) (saga.Command, error) {
		return func(o order) (saga.Command, error) {
			return saga.Command{Topic: "commands", Type: typ, Payload: o}, nil
		}
	}
	def := saga.MustDefine("orders",
		saga.Step[order]{Name: "reserve", Command: cmd("reserve"), Compensation: cmd("release")},
		saga.Step[order]{Name: "approval", WaitFor: "order.approved", Timeout: 24 * time.Hour},
		saga.Step[order]{Name: "ship", Command: cmd("ship"), NoCompensation: true},
	)
	sim, _ := sagatest.NewSimulator(def)
	for _, id := range []string{"o-1", "o-2"} {
		_ = sim.Start(id, order{ID: id})
		_ = sim.Succeed(id, "reserve")
	}
	_ = sim.Advance(2 * time.Hour)
	fmt.Println(sim.Signal("o-1", "order.approved", nil))
	_ = sim.Succeed("o-1", "ship")
	_ = sim.Advance(22 * time.Hour) // o-2's wait times out: no answer meanwhile
	fmt.Println(sim.Signal("o-2", "order.approved", nil) != nil)
	_ = sim.RunUntilIdle()
	fmt.Println(sim.State("o-1"), sim.Trace("o-1"))
	fmt.Println(sim.State("o-2"), sim.Trace("o-2"))
	// Output:
	// <nil>
	// true
	// completed [reserve/forward/1 ship/forward/1]
	// compensated [reserve/forward/1 reserve/compensation/1]
}
