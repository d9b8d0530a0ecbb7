package sagatest_test

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

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
)

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
	if _, err := migrate.Up(context.Background(), postgres.From(db), outbox.Migrations(), saga.Migrations()); err != nil {
		panic(err)
	}
	return db, func() {
		db.Close()
		admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
		admin.Close()
	}
}

// A scripted participant refuses the second step; the first is compensated.
func ExampleParticipant() {
	ctx := context.Background()
	db, cleanup := exampleDB()
	defer cleanup()
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})

	cmd := func(o struct{}) (saga.Command, error) { return saga.Command{Topic: "commands", Payload: o}, nil }
	def := saga.MustDefine("transfer",
		saga.Step[struct{}]{Name: "debit", Command: cmd, Compensation: cmd},
		saga.Step[struct{}]{Name: "credit", Command: cmd, Compensation: cmd},
	)
	o, _ := saga.NewOrchestrator(postgres.From(db), def, saga.Config{})
	p := sagatest.NewParticipant(broker)
	p.Script(func(c sagatest.Command) sagatest.Answer {
		if c.Step == "credit" {
			return sagatest.Fail
		}
		return sagatest.Succeed
	})

	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	router.AddConsumerHandler("participant", "commands", broker, p.Handle)
	// Without the idempotency middleware HandleReply uses its own
	// transaction; production code adds the middleware.
	router.AddConsumerHandler("orchestrator", o.ReplyTopic(), broker, o.HandleReply)
	go router.Run(ctx)
	defer router.Close()
	<-router.Running()
	rel, _ := relay.New(postgres.From(db), broker, relay.Config{PollInterval: 10 * time.Millisecond})
	go rel.Run(ctx)
	defer rel.Close()

	_ = o.StartOutsideTx(ctx, postgres.From(db), "t-1", struct{}{})
	wait, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	info, err := sagatest.WaitState(wait, postgres.From(db), "t-1", saga.StateCompleted, saga.StateCompensated)
	fmt.Println(info.State, err)
	fmt.Println(p.Trace("t-1"))
	// Output:
	// compensated <nil>
	// [debit/forward/1 credit/forward/1 debit/compensation/1]
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
