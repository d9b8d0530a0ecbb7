package retention_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"

	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
)

// A service keeps each of its tables trimmed by that table's cleaner,
// each with its default age unless the Config says otherwise. (Compiled,
// not run: it needs a database.)
func Example() {
	ctx := context.Background()
	pool, err := postgres.Open("postgres://localhost/orders") // a *sql.DB; postgres.Pgx for a *pgxpool.Pool
	if err != nil {
		log.Fatal(err)
	}
	db := postgres.From(pool)
	for _, open := range []func(postgres.DB, retention.Config) (*retention.Cleaner, error){
		retention.NewOutboxCleaner, retention.NewIdempotencyCleaner, retention.NewDeadLetterCleaner, retention.NewSagaCleaner,
	} {
		c, err := open(db, retention.Config{})
		if err != nil {
			log.Fatal(err)
		}
		go func() { _ = c.Run(ctx) }() // a round now, then every Config.Interval
		defer c.Close()
	}
}

// Each table's default age; a Config below the table's minimum is refused
// with an error naming the table and the setting.
func Example_defaults() {
	fmt.Println(retention.DefaultOutboxRetention, retention.DefaultDeadLetterRetention, retention.DefaultSagaRetention)
	_, err := retention.NewDeadLetterCleaner(postgres.From(new(sql.DB)), retention.Config{Retention: 0})
	fmt.Println(err)
	_, err = retention.NewDeadLetterCleaner(postgres.From(new(sql.DB)), retention.Config{Retention: 1})
	fmt.Println(err)
	// Output:
	// 168h0m0s 2160h0m0s 720h0m0s
	// <nil>
	// dlq cleaner: retention.Config.Retention 1ns is too short: want at least 1h0m0s (default 2160h0m0s)
}
