package sql

import (
	"errors"
	"fmt"

	"github.com/lib/pq"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/storage"
)

// pingError says why the first ping failed and what to check; an answer
// of the server that waiting cannot fix is marked failure.Permanent.
func pingError(cfg Config, urlFrom string, err error) error {
	where, check := "the shared pool (Config.DB)", "Config.DB"
	if cfg.DB == nil {
		where, check = redact.URL(cfg.URL)+" (from "+urlFrom+")", urlFrom
	}
	code := storage.Code(err) // lib/pq's, or pgx's through its stdlib adapter
	switch {
	case code == "28P01" || code == "28000":
		return failure.Permanent(fmt.Errorf("sql: %s refused the connection's credentials: %w (fix the user and password in %s, or pg_hba.conf)", where, err, check))
	case code == "3D000":
		return failure.Permanent(fmt.Errorf("sql: %s: %w (create the database, or fix its name in %s)", where, err, check))
	case errors.Is(err, pq.ErrSSLNotSupported):
		return failure.Permanent(fmt.Errorf("sql: %s: %w (set sslmode=disable in %s, or enable SSL on the server)", where, err, check))
	}
	return fmt.Errorf("sql: connecting to %s: %w (check %s and that Postgres is up)", where, err, check)
}
