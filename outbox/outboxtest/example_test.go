package outboxtest_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/lib/pq" // the "postgres" driver

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/outboxtest"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

func ExampleWaitDrained() {
	ctx := context.Background()
	admin, _ := sql.Open("postgres", exampleURL(""))
	defer admin.Close()
	schema := fmt.Sprintf("example_%d", time.Now().UnixNano())
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		fmt.Println("needs Postgres:", err)
		return
	}
	defer admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
	db, _ := sql.Open("postgres", exampleURL(schema))
	defer db.Close()
	_, _ = migrate.Up(ctx, postgres.From(db), outbox.Migrations())

	// The code under test writes an event...
	_ = outbox.AddOutsideTx(ctx, postgres.From(db), outbox.Event{Topic: "orders", AggregateID: "o-1", Payload: []byte(`{}`)})

	// ...a relay runs as in production...
	rel, _ := relay.New(postgres.From(db), gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}),
		relay.Config{PollInterval: 10 * time.Millisecond})
	go rel.Run(ctx)
	defer rel.Close()

	// ...and the test waits for it before asserting on the consumer side.
	wait, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	fmt.Println(outboxtest.WaitDrained(wait, postgres.From(db)))
	// Output: <nil>
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
