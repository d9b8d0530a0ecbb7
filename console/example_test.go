package console_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	_ "github.com/lib/pq" // the "postgres" driver

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/postgres"
)

// authenticate is the host's own authentication middleware: here every
// request is "alice".
func authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(w, r.WithContext(console.WithActor(r.Context(), "alice")))
	})
}

// Mount the console under /ops behind the host's authentication.
func ExampleNew() {
	db, cleanup := exampleDB()
	defer cleanup()
	h, err := console.New(postgres.From(db), console.Config{Authenticate: console.ContextActor, BasePath: "/ops"})
	if err != nil {
		fmt.Println(err)
		return
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/", authenticate(h))

	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/ops/dead-letters", nil))
	fmt.Println(rec.Code, rec.Header().Get("X-Frame-Options"))
	// Output:
	// 200 DENY
}

func exampleDB() (*sql.DB, func()) {
	base := os.Getenv("MILLWRIGHT_TEST_DATABASE_URL")
	if base == "" {
		base = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	admin, err := sql.Open("postgres", base)
	if err != nil {
		panic(err)
	}
	schema := fmt.Sprintf("example_console_%d", time.Now().UnixNano())
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		fmt.Fprintln(os.Stderr, "the example needs Postgres:", err)
		os.Exit(1)
	}
	db, err := sql.Open("postgres", base+"&search_path="+schema)
	if err != nil {
		panic(err)
	}
	if _, err := migrate.Up(context.Background(), postgres.From(db), migrations.All()...); err != nil {
		panic(err)
	}
	return db, func() {
		db.Close()
		_, _ = admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
		admin.Close()
	}
}
