package app_test

import (
	"context"
	"database/sql"
	"fmt"

	_ "github.com/lib/pq"

	"github.com/millwright/millwright/examples/orders/app"
	"github.com/millwright/millwright/transport"
)

// The order workflow as a Mermaid diagram (no database is reached: sql.Open
// does not connect).
func Example() {
	db, _ := sql.Open("postgres", "postgres://127.0.0.1:1/none")
	defer db.Close()
	tr, _ := transport.Open(context.Background(), transport.Config{Kind: transport.GoChannel})
	defer tr.Close()
	a, err := app.New(app.Config{DB: db, Transport: tr})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Print(a.Mermaid())
	// Output:
	// stateDiagram-v2
	//     %% saga order_fulfilment
	//     [*] --> prepare
	//     state prepare {
	//         state prepare_fork <<fork>>
	//         state prepare_join <<join>>
	//         [*] --> prepare_fork
	//         prepare_fork --> reserve
	//         reserve --> prepare_join: reserve.succeeded, reserve.failed or timeout 1m0s
	//         prepare_fork --> charge
	//         charge --> prepare_join: charge.succeeded, charge.failed or timeout 1m0s
	//         prepare_join --> [*]
	//     }
	//     prepare --> ship: every branch succeeded
	//     prepare --> undo_charge: a branch failed or timed out
	//     prepare --> undo_reserve: a branch failed or timed out
	//     prepare --> Compensated: a branch failed or timed out
	//     note right of prepare: after a failure the running branches are awaited; then the branches that succeeded or timed out are compensated, the failed ones skipped
	//     ship --> Completed: ship.succeeded
	//     ship --> undo_charge: ship.failed
	//     ship --> undo_ship: timeout 1m0s
	//     undo_ship --> undo_charge: ship.compensated
	//     undo_ship --> undo_ship: ship.compensation_failed (retry)
	//     undo_ship --> Stuck: retries exhausted
	//     undo_charge --> undo_reserve: charge.compensated
	//     undo_charge --> Compensated: charge.compensated
	//     undo_charge --> undo_charge: charge.compensation_failed (retry)
	//     undo_charge --> Stuck: retries exhausted
	//     undo_reserve --> Compensated: reserve.compensated
	//     undo_reserve --> undo_reserve: reserve.compensation_failed (retry)
	//     undo_reserve --> Stuck: retries exhausted
	//     Compensated --> undo_ship: ship.succeeded late
	//     Compensated --> undo_charge: charge.succeeded late
	//     Compensated --> undo_reserve: reserve.succeeded late
	//     note right of Stuck: millwright saga resolve ID (retry or skip)
	//     Completed --> [*]
	//     Compensated --> [*]
}
