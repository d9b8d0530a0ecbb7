// Command sqlwakecost measures what the sql transport's wake-up trigger
// costs writers: commits/s of concurrent one-row transactions into a
// watermill-sql-shaped table with no trigger, with the trigger that always
// notified (the version before the wake-up lock), and with the lock-guarded
// trigger (internal/storage's, the transport's own statements) while no
// consumer waits and while one waits (holds the table's wake-up lock and
// LISTENs). Even rounds run the scenarios in reverse order so that the machine's load
// weighs on each alike; ratios are against the always-notifying trigger
// of the same round.
//
//	go run ./scripts/sqlwakecost -url "$MILLWRIGHT_TEST_DATABASE_URL" -clients 4 -seconds 8 -rounds 2
package main

import (
	"context"
	stdsql "database/sql"
	"flag"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	_ "github.com/lib/pq"

	"github.com/millwright/millwright/internal/storage"
)

const alwaysNotify = `CREATE FUNCTION millwright_sql_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
	PERFORM pg_notify('` + storage.SQLNotifyChannel + `', TG_RELID::text || ' ' || pg_current_xact_id()::text);
	RETURN NULL;
END $fn$`

const table = `"watermill_wakecost"`

type scenario struct {
	name    string
	trigger string // "", "always", "guarded"
	waiting bool
}

var scenarios = []scenario{
	{"no trigger", "", false},
	{"always notifying", "always", false},
	{"lock-guarded, no consumer waiting", "guarded", false},
	{"lock-guarded, a consumer waiting", "guarded", true},
}

func main() {
	url := flag.String("url", os.Getenv("MILLWRIGHT_TEST_DATABASE_URL"), "Postgres URL")
	clients := flag.Int("clients", 4, "concurrent writers (one connection each)")
	seconds := flag.Int("seconds", 8, "duration of each scenario in a round")
	rounds := flag.Int("rounds", 2, "rounds over all scenarios")
	flag.Parse()
	if *url == "" {
		fmt.Fprintln(os.Stderr, "sqlwakecost: no -url (or MILLWRIGHT_TEST_DATABASE_URL)")
		os.Exit(2)
	}
	if err := run(*url, *clients, time.Duration(*seconds)*time.Second, *rounds); err != nil {
		fmt.Fprintln(os.Stderr, "sqlwakecost:", err)
		os.Exit(1)
	}
}

func run(url string, clients int, d time.Duration, rounds int) error {
	ctx := context.Background()
	fmt.Printf("%d writers, one row per transaction, %s per scenario, %d rounds (commits/s; ratio to always notifying in the same round)\n", clients, d, rounds)
	for r := 1; r <= rounds; r++ {
		rates := make([]float64, len(scenarios))
		for k := range scenarios {
			i := k
			if r%2 == 0 { // the reverse order: a load that changes weighs alike
				i = len(scenarios) - 1 - k
			}
			sc := scenarios[i]
			rate, err := measure(ctx, url, sc, clients, d, fmt.Sprintf("wakecost_%d_%d_%d", os.Getpid(), r, i))
			if err != nil {
				return fmt.Errorf("%s: %w", sc.name, err)
			}
			rates[i] = rate
		}
		for i, sc := range scenarios {
			fmt.Printf("round %d  %-36s %8.0f  %.2fx\n", r, sc.name, rates[i], rates[i]/rates[1])
		}
	}
	return nil
}

// measure runs sc in a schema of its own (dropped after) and returns its
// commits/s.
func measure(ctx context.Context, url string, sc scenario, clients int, d time.Duration, schema string) (float64, error) {
	admin, err := stdsql.Open("postgres", url)
	if err != nil {
		return 0, err
	}
	defer admin.Close()
	if _, err := admin.ExecContext(ctx, `CREATE SCHEMA `+schema); err != nil {
		return 0, err
	}
	defer admin.ExecContext(context.WithoutCancel(ctx), `DROP SCHEMA `+schema+` CASCADE`) //nolint:errcheck
	db, err := stdsql.Open("postgres", url+"&search_path="+schema)
	if err != nil {
		return 0, err
	}
	defer db.Close()
	db.SetMaxOpenConns(clients + 2)
	if err := prepare(ctx, db, sc); err != nil {
		return 0, err
	}
	if sc.waiting {
		release, err := holdLock(ctx, db, url)
		if err != nil {
			return 0, err
		}
		defer release()
	}
	var commits atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Value
	stop := time.Now().Add(d)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				if _, err := db.ExecContext(ctx, `INSERT INTO `+table+` (uuid, payload, transaction_id) VALUES (gen_random_uuid()::text, '\x7b7d', pg_current_xact_id())`); err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				commits.Add(1)
			}
		}()
	}
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		return 0, err
	}
	return float64(commits.Load()) / d.Seconds(), nil
}

func prepare(ctx context.Context, db *stdsql.DB, sc scenario) error {
	stmts := []string{`CREATE TABLE ` + table + ` ("offset" BIGSERIAL, uuid VARCHAR(36) NOT NULL, created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
		payload BYTEA DEFAULT NULL, metadata JSON DEFAULT NULL, transaction_id xid8 NOT NULL, PRIMARY KEY (transaction_id, "offset"))`}
	switch sc.trigger {
	case "always":
		stmts = append(stmts, alwaysNotify, `CREATE TRIGGER millwright_notify AFTER INSERT ON `+table+` FOR EACH STATEMENT EXECUTE FUNCTION millwright_sql_notify()`)
	case "guarded":
		stmts = append(stmts, storage.SQLNotifySchemaStatements(table)...)
	}
	for _, s := range stmts {
		if _, err := db.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	return nil
}

// holdLock makes a consumer wait on the table: a session holding its
// wake-up lock exclusively and a LISTEN on the channel.
func holdLock(ctx context.Context, db *stdsql.DB, url string) (func(), error) {
	oid, err := storage.TableOID(ctx, storage.NewSQL(db), table)
	if err != nil {
		return nil, err
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := conn.ExecContext(ctx, fmt.Sprintf(`SELECT pg_advisory_lock(%d, %d)`, storage.SQLWakeLockClass, int32(oid))); err != nil {
		conn.Close()
		return nil, err
	}
	lctx, cancel := context.WithCancel(ctx)
	l, err := storage.NewListener(lctx, storage.DriverSQL, storage.ListenerConfig{URL: url})
	if err == nil {
		err = l.Listen(lctx, storage.SQLNotifyChannel)
	}
	if err != nil {
		cancel()
		conn.Close()
		return nil, err
	}
	go func() {
		for range l.Notifications() { //nolint:revive // drain
		}
	}()
	return func() { cancel(); _ = l.Close(); _ = conn.Close() }, nil
}
