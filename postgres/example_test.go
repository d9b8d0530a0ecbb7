package postgres_test

import (
	"fmt"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/postgres"
)

// A service opens its pool with postgres.Open and hands it to millwright's
// stores: the idempotency mark then travels with BEGIN.
func ExampleOpen() {
	db, err := postgres.Open("postgres://app@127.0.0.1:5432/orders?sslmode=disable")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()
	store, err := idempotency.NewPostgresStore(postgres.From(db))
	fmt.Println(store != nil, err)
	// Output: true <nil>
}
