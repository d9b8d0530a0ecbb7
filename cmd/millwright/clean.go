package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/retention"
)

// Retention from the CLI: `millwright clean` runs one round of every
// table's cleaner; `millwright <component> clean` one table's. Both are
// state-changing commands (safety.go): --dry-run counts, a terminal is
// asked to confirm, --yes is required elsewhere, every run is audited.

func init() {
	rootCmd.AddCommand(cleanAllCmd())
}

// cleanTarget is one table with a retention cleaner.
type cleanTarget struct {
	component string // the command it hangs under, and its flag prefix in `millwright clean`
	rows      string // what is deleted, for messages
	retention time.Duration
	open      openCleaner
	// consequence is what the prompt warns of.
	consequence string
}

// cleanTargets lists every table millwright writes, in the order
// `millwright clean` cleans them.
var cleanTargets = []cleanTarget{
	{"outbox", "published outbox events", retention.DefaultOutboxRetention, retention.NewOutboxCleaner,
		"they can no longer be inspected or re-published"},
	{"idempotency", "processed marks", retention.DefaultIdempotencyRetention, retention.NewIdempotencyCleaner,
		"redeliveries of those events will be processed again"},
	{"dlq", "dead letters", retention.DefaultDeadLetterRetention, retention.NewDeadLetterCleaner,
		"replayed or not, they can no longer be replayed"},
	{"saga", "completed and compensated sagas (with their steps)", retention.DefaultSagaRetention, retention.NewSagaCleaner,
		"a reply still arriving for one of them fails as not found"},
	{"audit", "audit rows", retention.DefaultAuditRetention, retention.NewAuditCleaner,
		"the record of those commands is lost"},
}

func target(component string) cleanTarget {
	for _, t := range cleanTargets {
		if t.component == component {
			return t
		}
	}
	panic("cmd/millwright: no clean target " + component)
}

// cleanCmd is `millwright <component> clean`.
func cleanCmd(component string) *cobra.Command {
	t := target(component)
	cmd := &cobra.Command{
		Use:   "clean",
		Short: "Delete " + t.rows + " older than the retention period, once",
		Long: `Delete ` + t.rows + ` older than --retention, --batch-size rows per
statement, as the component's Cleaner does every interval. Skips (and says so)
when another cleaner holds the lock. --dry-run counts the rows that would be
deleted. On a terminal it shows that count and asks to confirm; elsewhere --yes
is required. Every run past flag validation is recorded in
millwright_audit (a dry run writes nothing else).
Progress (rows deleted of those counted) goes to stderr.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			age, _ := cmd.Flags().GetDuration("retention")
			batch, _ := cmd.Flags().GetInt("batch-size")
			return runClean(cmd, args, []cleanTarget{t}, func(cleanTarget) time.Duration { return age }, batch)
		},
	}
	cmd.Flags().Duration("retention", t.retention, "keep "+t.rows+" this long")
	cmd.Flags().Int("batch-size", retention.DefaultBatchSize, fmt.Sprintf("rows per DELETE statement (1 to %d)", retention.MaxBatchSize))
	addSafetyFlags(cmd)
	addDatabaseFlag(cmd)
	return cmd
}

// cleanAllCmd is `millwright clean`.
func cleanAllCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "clean",
		Short: "Apply the retention of every millwright table, once (outbox, idempotency, dlq, saga, audit)",
		Long: `Run one round of every retention cleaner: published outbox events, processed
marks, dead letters, completed and compensated sagas with their steps, audit
rows; each older than its --<component>-retention, --batch-size rows per
statement. A table whose cleaner is busy elsewhere is skipped (and said so).
--dry-run counts what would be deleted. On a terminal it shows the counts and
asks to confirm; elsewhere --yes is required. Every run past flag validation
is recorded in millwright_audit (a dry run writes nothing else). Progress
(rows deleted of those counted) goes to stderr. Every table must exist: run
` + "`millwright migrate`" + ` first.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			batch, _ := cmd.Flags().GetInt("batch-size")
			return runClean(cmd, args, cleanTargets, func(t cleanTarget) time.Duration {
				d, _ := cmd.Flags().GetDuration(t.component + "-retention")
				return d
			}, batch)
		},
	}
	for _, t := range cleanTargets {
		cmd.Flags().Duration(t.component+"-retention", t.retention, "keep "+t.rows+" this long")
	}
	cmd.Flags().Int("batch-size", retention.DefaultBatchSize, fmt.Sprintf("rows per DELETE statement (1 to %d)", retention.MaxBatchSize))
	addSafetyFlags(cmd)
	addDatabaseFlag(cmd)
	return cmd
}

// retentionFlag names the flag of t's retention on cmd: --retention on
// `<component> clean`, --<component>-retention on `clean`.
func retentionFlag(cmd *cobra.Command, t cleanTarget) string {
	if cmd.Flags().Lookup("retention") != nil {
		return "retention"
	}
	return t.component + "-retention"
}

// buildCleaners builds the cleaner of each target into cleaners, on the
// command's pool (--driver), which also carries the run's audit row.
func buildCleaners(cmd *cobra.Command, pool *cliPool, targets []cleanTarget, cleaners []*retention.Cleaner, age func(cleanTarget) time.Duration, batch int) error {
	var errs []error
	for i, t := range targets {
		var err error
		if cleaners[i], err = t.open(pool.handle(), retention.Config{Retention: age(t), BatchSize: batch}); err != nil {
			errs = append(errs, fmt.Errorf("%s --%s=%s --batch-size=%d: %w", cmd.CommandPath(), retentionFlag(cmd, t), age(t), batch, err))
		}
	}
	return errors.Join(errs...)
}

// runClean counts (dry run) or cleans each target once, printing a line
// per table, and audits the run with the total.
func runClean(cmd *cobra.Command, args []string, targets []cleanTarget, age func(cleanTarget) time.Duration, batch int) error {
	// The cleaners are built, and so their retention and batch size
	// validated, before anything is written (the audit row included).
	cleaners := make([]*retention.Cleaner, len(targets))
	change, pool, err := openChange(cmd, args, func(pool *cliPool) error {
		return buildCleaners(cmd, pool, targets, cleaners, age, batch)
	})
	if err != nil {
		return err
	}
	defer pool.Close()
	ctx := cmd.Context()
	out := cmd.OutOrStdout()
	count := func() (counts []int64, total int64, err error) {
		for _, c := range cleaners {
			n, err := c.Count(ctx)
			if err != nil {
				return nil, total, err
			}
			counts = append(counts, n)
			total += n
		}
		return counts, total, nil
	}
	if change.dryRun {
		counts, total, err := count()
		for i, n := range counts {
			fmt.Fprintf(out, "dry run: would delete %d %s older than %s\n", n, targets[i].rows, cleaners[i].Config().Retention)
		}
		return change.finish(total, err)
	}
	err = change.confirm(func() (string, error) {
		counts, _, err := count()
		var b strings.Builder
		for i, n := range counts {
			fmt.Fprintf(&b, "will delete %d %s older than %s (%s)\n", n, targets[i].rows, cleaners[i].Config().Retention, targets[i].consequence)
		}
		return b.String(), err
	})
	if err != nil {
		return change.finish(0, err)
	}
	_, toDelete, err := count()
	if err != nil {
		return change.finish(0, err)
	}
	prog := newProgress(cmd, strings.TrimPrefix(cmd.CommandPath(), rootCmd.Name()+" "), "rows", toDelete)
	out = cmd.OutOrStdout() // wrapped by newProgress on a terminal
	var total int64
	for i, c := range cleaners {
		before := total
		stats, err := c.RunOnceWithProgress(ctx, func(deleted int64) { prog.Set(before + deleted) })
		total += stats.Deleted
		if err != nil {
			// Each batch is its own committed transaction.
			prog.Stopped(stoppedBy(ctx, err), fmt.Sprintf("the %d row(s) deleted stay deleted; re-running continues safely with the rest", total))
			return change.finish(total, err)
		}
		if stats.Skipped {
			fmt.Fprintf(out, "%s: another cleaner holds the lock; skipped\n", targets[i].rows)
			continue
		}
		fmt.Fprintf(out, "deleted %d %s in %d batches\n", stats.Deleted, targets[i].rows, stats.Batches)
		if stats.PartitionsCreated+stats.PartitionsDropped > 0 || len(stats.PartitionsKept) > 0 || stats.DefaultRows > 0 {
			// The partitioned outbox drops whole partitions instead.
			fmt.Fprintf(out, "%s: dropped %d partitions (about %d rows), created %d ahead, kept %d past the retention %v, %d rows in the DEFAULT partition\n",
				targets[i].rows, stats.PartitionsDropped, stats.DroppedRows, stats.PartitionsCreated, len(stats.PartitionsKept), stats.PartitionsKept, stats.DefaultRows)
		}
	}
	prog.Finish("")
	return change.finish(total, nil)
}
