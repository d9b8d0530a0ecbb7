package millwright_test

import (
	"context"
	"errors"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	_ "github.com/millwright/millwright/transport/all" // MILLWRIGHT_TRANSPORT chooses among every kind
)

// A service on the client: a handler whose effect commits once per
// event, an event written with the business row, HTTP health and
// metrics, and Run until SIGTERM. (Not run: it needs a database.)
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := postgres.OpenPgx(ctx, os.Getenv("MILLWRIGHT_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	db := postgres.Pgx(pool)
	client, err := millwright.NewClient(db, millwright.Config{Name: "shop", Migrate: true})
	if err != nil {
		log.Fatal(err)
	}
	err = client.Handle("ship", "shop.orders", func(ctx context.Context, tx postgres.Tx, msg *message.Message) error {
		_, err := tx.Pgx().Exec(ctx, `INSERT INTO shipments (order_id) VALUES ($1)`, string(msg.Payload))
		return err // committed with the event's idempotency mark, or retried, parked, dead-lettered
	}, millwright.HandlerConfig{})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = http.ListenAndServe("127.0.0.1:9090", client.Handler()) }() // /healthz, /readyz, /metrics
	go func() {
		<-client.Running()
		err := db.InTx(ctx, func(tx postgres.Tx) error {
			_, err := tx.Pgx().Exec(ctx, `INSERT INTO orders (id) VALUES ('o-1')`)
			return errors.Join(err, client.Add(ctx, tx, outbox.Event{Topic: "shop.orders", AggregateType: "order", AggregateID: "o-1", Payload: []byte("o-1")}))
		})
		if err != nil {
			log.Print(err)
		}
	}()
	if err := client.Run(ctx); err != nil { // nil when the handlers in flight finished within the grace
		log.Fatal(err)
	}
}
