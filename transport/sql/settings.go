package sql

import (
	"errors"
	"net/url"

	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/transport"
)

// kindSettings is how transport.ParseURL and transport.FromEnv read the
// sql kind: postgres:// URLs, MILLWRIGHT_SQL_URL and, failing it,
// MILLWRIGHT_DATABASE_URL.
var kindSettings = transport.Settings{
	Schemes:  []string{"postgres"},
	Aliases:  []string{"postgresql"},
	ParseURL: parseURL,
	FromEnv:  fromEnv,
	Fields: map[string]func(transport.Config) string{
		"SQL.URL": func(c transport.Config) string { return c.SQL.URL },
	},
	Describe: func(c transport.Config) string {
		if c.SQL.URL == "" {
			return "sql (shared pool)"
		}
		return redact.URL(c.SQL.URL)
	},
}

func parseURL(c *transport.Config, u transport.URL) error {
	if _, err := url.Parse(u.Raw); err != nil {
		return errors.New("transport: malformed postgres URL (not shown: it may hold a password): want postgres://user:pass@host:5432/db")
	}
	c.SQL.URL = u.Raw
	return nil
}

// fromEnv reads MILLWRIGHT_SQL_URL, or MILLWRIGHT_DATABASE_URL when
// neither it nor the transport URL gives the database, and
// MILLWRIGHT_SQL_LISTEN_URL.
func fromEnv(cfg *transport.Config, env transport.Env) error {
	if v := env.Get(transport.EnvSQLURL); v != "" {
		cfg.SQL.URL = v
		env.From("SQL.URL", transport.EnvSQLURL)
	} else if v := env.Get(transport.EnvDatabaseURL); v != "" && cfg.SQL.URL == "" {
		cfg.SQL.URL = v
		env.From("SQL.URL", transport.EnvDatabaseURL)
	}
	if v := env.Get(transport.EnvSQLListenURL); v != "" {
		cfg.SQL.ListenURL = v
	}
	return nil
}
