package outboxtest_test

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
)

func ExampleWaitDrained() {
	ctx := context.Background()
	admin, _ := sql.Open("postgres", pgtest.BaseURL())
	defer admin.Close()
	schema := fmt.Sprintf("example_%d", time.Now().UnixNano())
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		fmt.Println("needs Postgres:", err)
		return
	}
	defer admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
	db, _ := sql.Open("postgres", pgtest.WithSearchPath(pgtest.BaseURL(), schema))
	defer db.Close()
	_, _ = migrate.Up(ctx, db, outbox.Migrations())

	// The code under test writes an event...
	_ = outbox.Add(ctx, db, outbox.Event{Topic: "orders", AggregateID: "o-1", Payload: []byte(`{}`)})

	// ...a relay runs as in production...
	relay, _ := outbox.NewRelay(db, gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}),
		outbox.RelayConfig{PollInterval: 10 * time.Millisecond})
	go relay.Run(ctx)
	defer relay.Close()

	// ...and the test waits for it before asserting on the consumer side.
	wait, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	fmt.Println(outboxtest.WaitDrained(wait, db))
	// Output: <nil>
}
