package saga_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/lib/pq" // the "postgres" driver

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// exampleDB opens a scratch schema on the local test server with the
// outbox, idempotency and saga migrations applied.
func exampleDB() (*sql.DB, func()) {
	admin, err := sql.Open("postgres", exampleURL(""))
	if err != nil {
		panic(err)
	}
	schema := fmt.Sprintf("example_%d", time.Now().UnixNano())
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		fmt.Fprintln(os.Stderr, "example needs Postgres:", err)
		os.Exit(1)
	}
	db, _ := sql.Open("postgres", exampleURL(schema))
	if _, err := migrate.Up(context.Background(), postgres.From(db), outbox.Migrations(), idempotency.Migrations(), saga.Migrations()); err != nil {
		panic(err)
	}
	return db, func() {
		db.Close()
		admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
		admin.Close()
	}
}

// ShopOrder is the data of the example saga.
type ShopOrder struct {
	ID            string
	ReservationID string
}

// shopSaga reserves inventory, charges the payment and schedules shipping;
// release, refund and cancel undo them.
func shopSaga() *saga.Definition[ShopOrder] {
	command := func(topic, typ string) func(ShopOrder) (saga.Command, error) {
		return func(o ShopOrder) (saga.Command, error) {
			return saga.Command{Topic: topic, Type: typ, Payload: o}, nil
		}
	}
	return saga.MustDefine("shop_orders",
		saga.Step[ShopOrder]{
			Name:    "reserve_inventory",
			Command: command("inventory", "inventory.reserve.v1"),
			OnSuccess: func(o *ShopOrder, r saga.Reply) error {
				return r.Decode(&o.ReservationID)
			},
			Compensation: command("inventory", "inventory.release.v1"),
		},
		saga.Step[ShopOrder]{
			Name:         "charge_payment",
			Command:      command("payments", "payment.charge.v1"),
			Compensation: command("payments", "payment.refund.v1"),
		},
		saga.Step[ShopOrder]{
			Name:         "schedule_shipping",
			Command:      command("shipping", "shipping.schedule.v1"),
			Compensation: command("shipping", "shipping.cancel.v1"),
		},
	)
}

// An order whose shipping cannot be scheduled: the payment is refunded and
// the reservation released, in that order.
func Example() {
	ctx := context.Background()
	db, cleanup := exampleDB()
	defer cleanup()
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})

	orders, _ := saga.NewOrchestrator(postgres.From(db), shopSaga(), saga.Config{PollInterval: 50 * time.Millisecond})
	store, _ := idempotency.NewPostgresStore(postgres.From(db))
	dedup, _ := idempotency.NewMiddleware(store, idempotency.Config{Consumer: "shop-orders-saga", Registerer: nil})

	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	router.AddConsumerHandler("orchestrator", orders.ReplyTopic(), broker, orders.HandleReply).
		AddMiddleware(dedup.Middleware)
	// The participants: shipping refuses, the others succeed.
	for _, topic := range []string{"inventory", "payments", "shipping"} {
		router.AddConsumerHandler(topic, topic, broker, func(cmd *message.Message) error {
			step, phase := cmd.Metadata.Get(metadata.SagaStep), cmd.Metadata.Get(metadata.SagaPhase)
			fmt.Println("participant got", cmd.Metadata.Get(metadata.EventType))
			typ, body := step+".succeeded", any("res-1")
			if phase == saga.PhaseCompensation {
				typ = step + ".compensated"
			} else if step == "schedule_shipping" {
				typ = step + ".failed"
			}
			reply, err := saga.NewReply(cmd, typ, body)
			if err != nil {
				return err
			}
			if typ == "schedule_shipping.failed" {
				reply.Metadata.Set(metadata.SagaError, "no courier for this address")
			}
			return broker.Publish(saga.ReplyTopic(cmd), reply)
		})
	}
	go router.Run(ctx)
	defer router.Close()
	<-router.Running()
	rel, _ := relay.New(postgres.From(db), broker, relay.Config{PollInterval: 10 * time.Millisecond})
	go rel.Run(ctx)
	defer rel.Close()
	go orders.Run(ctx)
	defer orders.Close()

	tx, _ := db.BeginTx(ctx, nil)
	// ... the order's own rows are written in tx too ...
	if err := orders.Start(ctx, postgres.SQLTx(tx), "order-7", ShopOrder{ID: "order-7"}); err != nil {
		fmt.Println(err)
		return
	}
	_ = tx.Commit()

	for deadline := time.Now().Add(time.Minute); ; {
		info, _, _ := saga.Get(ctx, postgres.From(db), "order-7")
		if time.Now().After(deadline) {
			fmt.Println("still", info.State, "after a minute")
			break
		}
		if info.State == saga.StateCompensated {
			fmt.Println("state:", info.State, "| reservation:", string(info.Data))
			fmt.Println("last error:", info.LastError)
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Output:
	// participant got inventory.reserve.v1
	// participant got payment.charge.v1
	// participant got shipping.schedule.v1
	// participant got payment.refund.v1
	// participant got inventory.release.v1
	// state: compensated | reservation: {"ID": "order-7", "ReservationID": "res-1"}
	// last error: step "schedule_shipping" failed: no courier for this address
}

func ExampleDefinition_Mermaid() {
	fmt.Print(shopSaga().Mermaid())
	// Output:
	// stateDiagram-v2
	//     %% saga shop_orders
	//     [*] --> reserve_inventory
	//     reserve_inventory --> charge_payment: reserve_inventory.succeeded
	//     reserve_inventory --> Compensated: reserve_inventory.failed
	//     reserve_inventory --> undo_reserve_inventory: timeout 1m0s
	//     charge_payment --> schedule_shipping: charge_payment.succeeded
	//     charge_payment --> undo_reserve_inventory: charge_payment.failed
	//     charge_payment --> undo_charge_payment: timeout 1m0s
	//     schedule_shipping --> Completed: schedule_shipping.succeeded
	//     schedule_shipping --> undo_charge_payment: schedule_shipping.failed
	//     schedule_shipping --> undo_schedule_shipping: timeout 1m0s
	//     undo_schedule_shipping --> undo_charge_payment: schedule_shipping.compensated
	//     undo_schedule_shipping --> undo_schedule_shipping: schedule_shipping.compensation_failed (retry)
	//     undo_schedule_shipping --> Stuck: retries exhausted
	//     undo_charge_payment --> undo_reserve_inventory: charge_payment.compensated
	//     undo_charge_payment --> undo_charge_payment: charge_payment.compensation_failed (retry)
	//     undo_charge_payment --> Stuck: retries exhausted
	//     undo_reserve_inventory --> Compensated: reserve_inventory.compensated
	//     undo_reserve_inventory --> undo_reserve_inventory: reserve_inventory.compensation_failed (retry)
	//     undo_reserve_inventory --> Stuck: retries exhausted
	//     Compensated --> undo_schedule_shipping: schedule_shipping.succeeded late
	//     Compensated --> undo_charge_payment: charge_payment.succeeded late
	//     Compensated --> undo_reserve_inventory: reserve_inventory.succeeded late
	//     note right of Stuck: millwright saga resolve ID (retry or skip)
	//     Completed --> [*]
	//     Compensated --> [*]
}

// exampleURL is the database the example uses, with search_path set to
// schema when one is given: $MILLWRIGHT_TEST_DATABASE_URL, else the local
// development server. Use your own.
func exampleURL(schema string) string {
	u := os.Getenv("MILLWRIGHT_TEST_DATABASE_URL")
	if u == "" {
		u = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	if schema == "" {
		return u
	}
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return u + sep + "search_path=" + schema
}
