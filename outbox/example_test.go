package outbox_test

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

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport"
)

// exampleDB opens a scratch schema on the local test server with the
// outbox's migrations applied.
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
	if _, err := migrate.Up(context.Background(), postgres.From(db), outbox.Migrations()); err != nil {
		panic(err)
	}
	return db, func() {
		db.Close()
		admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
		admin.Close()
	}
}

func Example() {
	ctx := context.Background()
	db, cleanup := exampleDB()
	defer cleanup()

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	received, _ := broker.Subscribe(ctx, "orders")

	// The business transaction writes its event with it.
	tx, _ := db.BeginTx(ctx, nil)
	_ = outbox.Add(ctx, postgres.SQLTx(tx), outbox.Event{
		Topic: "orders", AggregateType: "order", AggregateID: "o-1",
		EventType: "order.created.v1", Payload: []byte(`{"total":42}`),
	})
	_ = tx.Commit()

	rel, _ := relay.New(postgres.From(db), broker, relay.Config{PollInterval: 10 * time.Millisecond})
	go rel.Run(ctx)
	defer rel.Close()

	var msg *message.Message
	select {
	case msg = <-received:
		msg.Ack()
	case <-time.After(10 * time.Second):
		fmt.Println("no message within 10s")
		return
	}
	fmt.Println(msg.Metadata.Get(metadata.EventType), msg.Metadata.Get(metadata.OrderingKey), string(msg.Payload))

	wait, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	fmt.Println("drained:", outboxtest.WaitDrained(wait, postgres.From(db)) == nil)
	// Output:
	// order.created.v1 order/o-1 {"total": 42}
	// drained: true
}

// A Watermill publisher bound to the transaction: code that publishes with
// message.Publisher (a CQRS EventBus, say) writes to the outbox instead.
func ExampleNewTxPublisher() {
	ctx := context.Background()
	db, cleanup := exampleDB()
	defer cleanup()

	tx, _ := db.BeginTx(ctx, nil)
	var pub message.Publisher
	pub, _ = outbox.NewTxPublisher(postgres.SQLTx(tx), outbox.PublisherConfig{Source: "orders-service"})
	msg := message.NewMessage(watermill.NewUUID(), []byte("not JSON, kept as bytes"))
	msg.Metadata.Set(metadata.AggregateID, "o-1")
	_ = pub.Publish("orders", msg)
	_ = tx.Rollback() // a rolled-back transaction leaves nothing

	s, _ := outbox.ReadStats(ctx, postgres.From(db))
	fmt.Println("pending after rollback:", s.Pending)
	// Output:
	// pending after rollback: 0
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

// A Writer checks events against the limits of the transport its relay
// publishes to (here RabbitMQ's defaults) and gives events without a
// source its own.
func ExampleNewWriter() {
	w, err := outbox.NewWriter(outbox.WriterConfig{Limits: transport.DefaultLimits(transport.AMQP), Source: "/orders-service"})
	if err != nil {
		panic(err)
	}
	fmt.Println(w.Limits().MaxBytes, w.Source())

	// A lower broker limit than the kind's default.
	small, err := outbox.NewWriter(outbox.WriterConfig{Limits: transport.DefaultLimits(transport.Kafka), MaxEventBytes: 64 << 10})
	if err != nil {
		panic(err)
	}
	fmt.Println(small.Limits().MaxBytes, small.Limits().Setting)
	// Output:
	// 16777216 /orders-service
	// 65536 outbox.WriterConfig.MaxEventBytes
}
