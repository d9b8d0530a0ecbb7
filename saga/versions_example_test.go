package saga_test

import (
	"fmt"

	"github.com/millwright/millwright/saga"
)

// A changed saga is a new version; the old one stays registered while its
// instances run, each by its own steps.
func ExampleDefineVersion() {
	type Order struct{ ID string }
	step := func(name string) saga.Step[Order] {
		return saga.Step[Order]{Name: name, NoCompensation: true,
			Command: func(o Order) (saga.Command, error) { return saga.Command{Topic: name + "_commands", Payload: o}, nil }}
	}
	v1 := saga.MustDefine("orders", step("reserve"), step("charge"), step("ship"))
	v2, err := saga.DefineVersion("orders", 2, step("reserve"), step("fraud_check"), step("charge"), step("ship"))
	if err != nil {
		panic(err)
	}
	fmt.Println(v1.Version(), v1.Steps())
	fmt.Println(v2.Version(), v2.Steps())
	fmt.Println("same step graph:", v1.Fingerprint() == v2.Fingerprint())
	cfg := saga.Config{Versions: []saga.Versioned{v1}} // saga.NewOrchestrator(db, v2, cfg)
	fmt.Println("also runs version", cfg.Versions[0].Version())
	// Output:
	// 1 [reserve charge ship]
	// 2 [reserve fraud_check charge ship]
	// same step graph: false
	// also runs version 1
}
