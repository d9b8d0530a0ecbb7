package migrations_test

import (
	"fmt"

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/migrations"
)

// Every component's migrations, as `millwright migrate` applies them; pass
// them (with your own) to migrate.Up.
func ExampleAll() {
	for _, src := range migrations.All() {
		ms, err := migrate.Load(src)
		if err != nil {
			panic(err)
		}
		fmt.Println(src.Component, len(ms) > 0)
	}
	// Output:
	// outbox true
	// idempotency true
	// dlq true
	// park true
	// saga true
	// audit true
}
