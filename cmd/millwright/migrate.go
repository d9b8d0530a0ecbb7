package main

import (
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"github.com/lib/pq"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/cli/progress"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// migrationSources lists every component's migrations; components append to
// it from their own files' init functions.
var migrationSources []migrate.Source

func registerMigrations(src migrate.Source) { migrationSources = append(migrationSources, src) }

func init() { rootCmd.AddCommand(migrateCmd()) }

// migrateCmd is `millwright migrate`.
func migrateCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply the embedded SQL migrations of every component",
		Long: `Apply the embedded, versioned SQL migrations of every millwright component
to the database named by --database-url (default: $MILLWRIGHT_DATABASE_URL),
in the schema named by --schema (default: $MILLWRIGHT_SCHEMA, else the URL's
search_path), which it creates if missing. A search_path of the URL
naming only schemas that do not exist is an error naming them.
Safe to run from several processes at once: an advisory lock serialises them.
With --dry-run it lists the migrations it would apply, in order, and changes
nothing (add --sql to print each one's SQL).

With --outbox-partitioned it also applies the outbox's partitioned layout
(outbox.PartitionedMigrations): millwright_outbox becomes a table
partitioned by day on created_at, its rows moved in one transaction, and
the outbox cleaner drops whole partitions instead of deleting rows (the
copy's progress, rows moved of the total, goes to stderr). Without
it the outbox stays a plain table cleaned by batched DELETE. Once applied
the layout stays; later runs need not repeat the flag. See
docs/partitioning.md.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			dry, _ := cmd.Flags().GetBool("dry-run")
			withSQL, _ := cmd.Flags().GetBool("sql")
			if withSQL && !dry {
				return errors.New("--sql only prints, with --dry-run: nothing was applied")
			}
			notices := &migrateProgress{cmd: cmd}
			db, err := openDBWith(cmd, func(u string) (*sql.DB, error) { return pgconn.OpenWithNotices(u, notices.notice) })
			if err != nil {
				return err
			}
			defer db.Close()
			sources := migrationSources
			if partitioned, _ := cmd.Flags().GetBool("outbox-partitioned"); partitioned {
				sources = append(sources[:len(sources):len(sources)], outbox.PartitionedMigrations())
			}
			if dry {
				pending, err := migrate.Pending(cmd.Context(), postgres.From(db), sources...)
				if err != nil {
					return err
				}
				for _, m := range pending {
					fmt.Fprintf(cmd.OutOrStdout(), "would apply %s %03d_%s\n", m.Component, m.Version, m.Name)
					if withSQL {
						fmt.Fprintf(cmd.OutOrStdout(), "%s\n", strings.TrimRight(m.SQL, "\n"))
					}
				}
				if len(pending) == 0 {
					fmt.Fprintln(cmd.OutOrStdout(), "database is up to date")
				}
				return nil
			}
			if schema, _ := schemaOf(cmd); schema != "" {
				if err := storage.CreateSchema(cmd.Context(), storage.NewSQLPool(db), schema, true); err != nil {
					return fmt.Errorf("creating schema %s: %w", schema, err)
				}
			}
			applied, err := migrate.Up(cmd.Context(), postgres.From(db), sources...)
			if errors.Is(err, migrate.ErrNoSchema) {
				// Only the URL's search_path can name a missing schema:
				// the one of --schema was created above.
				err = fmt.Errorf("%w; or pass --schema NAME (or set $%s): `millwright migrate` creates the schema it names", err, envSchema)
			}
			notices.end(err)
			for _, a := range applied {
				fmt.Fprintf(cmd.OutOrStdout(), "applied %s %03d_%s\n", a.Component, a.Version, a.Name)
			}
			if err != nil {
				return err
			}
			if len(applied) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "database is up to date")
			}
			return nil
		},
	}
	addDatabaseFlag(cmd)
	cmd.Flags().Bool("dry-run", false, "list the migrations that would be applied; change nothing")
	cmd.Flags().Bool("sql", false, "with --dry-run, print each pending migration's SQL")
	cmd.Flags().Bool("outbox-partitioned", false, "also convert millwright_outbox to the layout partitioned by day (rows kept); see docs/partitioning.md")
	return cmd
}

// addDatabaseFlag adds --database-url to a command that talks to Postgres.
func addDatabaseFlag(cmd *cobra.Command) { cli.AddDatabaseFlag(cmd) }

// migrateProgress turns the progress notices of a migration (the
// partitioned-outbox conversion: "millwright progress: <what>: <done> of
// <total> rows moved") into a progress report.
type migrateProgress struct {
	cmd  *cobra.Command
	mu   sync.Mutex
	prog *progress.Reporter // nil until the first notice
}

var migrateProgressRe = regexp.MustCompile(`^millwright progress: (.+): (\d+) of (\d+) rows moved$`)

func (p *migrateProgress) notice(e *pq.Error) {
	m := migrateProgressRe.FindStringSubmatch(e.Message)
	if m == nil {
		return
	}
	done, _ := strconv.ParseInt(m[2], 10, 64)
	total, _ := strconv.ParseInt(m[3], 10, 64)
	p.mu.Lock()
	if p.prog == nil {
		p.prog = newProgress(p.cmd, "migrate: "+m[1], "rows", total)
	}
	prog := p.prog
	p.mu.Unlock()
	prog.Set(done)
}

// end ends the report, if a migration reported progress, with migrate.Up's
// error. Each migration is one transaction, applied whole or not at all.
func (p *migrateProgress) end(err error) {
	p.mu.Lock()
	prog := p.prog
	p.mu.Unlock()
	switch {
	case prog == nil:
	case err != nil:
		prog.Stopped(stoppedBy(p.cmd.Context(), err), "the conversion is one transaction, applied whole or not at all: re-running is safe and starts it over")
	default:
		prog.Finish("committed")
	}
}

// openDB opens the database of --database-url, working in the schema of
// --schema or $MILLWRIGHT_SCHEMA.
func openDB(cmd *cobra.Command) (*sql.DB, error) { return openDBWith(cmd, pgconn.Open) }

// commandURL is the database URL of --database-url (or its default) with
// the search_path of --schema or $MILLWRIGHT_SCHEMA.
func commandURL(cmd *cobra.Command) (string, error) {
	u, _ := cmd.Flags().GetString("database-url")
	schema, err := schemaOf(cmd)
	if err != nil {
		return "", err
	}
	return withSchema(cli.DatabaseURL(u), schema), nil
}

// openDBWith is openDB opening the pool with open.
func openDBWith(cmd *cobra.Command, open func(string) (*sql.DB, error)) (*sql.DB, error) {
	u, err := commandURL(cmd)
	if err != nil {
		return nil, err
	}
	return cli.OpenDB(cmd.Context(), u, open)
}
