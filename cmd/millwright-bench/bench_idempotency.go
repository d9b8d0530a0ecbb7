package main

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/benchdb"
	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/idempotencybench"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
)

func benchIdempotencyCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "idempotency",
		Short: "Messages/s and latency of a handler inserting one row, with and without the idempotency middleware",
		Long: `Runs a handler that inserts one row per message, first alone (its own
transaction), then behind the idempotency middleware in Transactional mode (the
mark is one more insert in the same transaction) and in MarkAfterSuccess mode.
Messages are fed straight to the handler by --workers goroutines, without a
broker, so the figures isolate the middleware's cost. Works in a scratch schema
that is dropped at the end. The variants alternate for --rounds rounds; each
figure is the median round's, and COST the median of the rounds' ratios of the
baseline's rate to the variant's.`,
		Args: cobra.NoArgs,
		RunE: runBenchIdempotency,
	}
	cmd.Flags().Int("messages", 4000, "messages per variant and round")
	cmd.Flags().Int("workers", 8, "concurrent handlers (each holds one connection)")
	cmd.Flags().Int("rounds", 5, "alternating rounds of every variant; the median is reported")
	cmd.Flags().Bool("json", false, "print one JSON object per row instead of the table")
	cli.AddDatabaseFlag(cmd)
	return cmd
}

func runBenchIdempotency(cmd *cobra.Command, _ []string) error {
	ctx := cmd.Context()
	var cfg idempotencybench.Config
	cfg.Messages, _ = cmd.Flags().GetInt("messages")
	cfg.Workers, _ = cmd.Flags().GetInt("workers")
	cfg.Rounds, _ = cmd.Flags().GetInt("rounds")
	asJSON, _ := cmd.Flags().GetBool("json")
	if cfg.Messages < 1 || cfg.Workers < 1 || cfg.Rounds < 1 {
		return errors.New("bench idempotency: --messages, --workers and --rounds must be at least 1")
	}
	admin, err := openDB(cmd)
	if err != nil {
		return err
	}
	defer admin.Close()
	u, _ := cmd.Flags().GetString("database-url")
	_, schemaURL, drop, err := benchdb.Scratch(ctx, admin, cli.DatabaseURL(u), "mw_bench")
	if err != nil {
		return err
	}
	defer drop()
	db, err := pgconn.Open(schemaURL)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(cfg.Workers)
	db.SetMaxIdleConns(cfg.Workers)
	if _, err := migrate.Up(ctx, postgres.From(db), idempotency.Migrations()); err != nil {
		return err
	}
	cfg.DB, cfg.URL = db, schemaURL
	if cfg.Drivers, err = benchDrivers(cmd); err != nil {
		return fmt.Errorf("bench idempotency: %w", err)
	}
	step, end := benchProgress(cmd)
	cfg.Progress = cmd.ErrOrStderr() // wrapped by benchProgress on a terminal
	cfg.Step = step
	rep, err := idempotencybench.Run(ctx, cfg)
	if err := end(err); err != nil {
		return err
	}
	if asJSON {
		return rep.WriteJSON(cmd.OutOrStdout())
	}
	return rep.WriteTable(cmd.OutOrStdout())
}
