package park_test

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
)

// BenchmarkHealthyKey measures what the middleware adds to a handler that
// succeeds, on a key that is not parked (one statement: the parked check),
// against the bare handler, on each driver. Run with -bench HealthyKey.
func BenchmarkHealthyKey(b *testing.B) {
	h := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	b.Run("bare", func(b *testing.B) {
		m := msg("m", "k")
		for b.Loop() {
			_, _ = h(m)
		}
	})
	for _, driver := range pgtest.Drivers() {
		b.Run(driver, func(b *testing.B) {
			s := pgtest.New(b, park.Migrations())
			var (
				p   *park.Parker
				err error
			)
			if driver == pgtest.DriverPgx {
				p, err = park.New(postgres.From(s.Pgx(b)), park.Config{})
			} else {
				p, err = park.New(postgres.From(s.DB), park.Config{})
			}
			if err != nil {
				b.Fatal(err)
			}
			wrapped := p.Middleware("bench")(h)
			i := 0
			for b.Loop() {
				i++
				if _, err := wrapped(msg(fmt.Sprint("m", i), fmt.Sprint("k", i%1000))); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
