package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/outbox"
)

func init() {
	registerMigrations(outbox.Migrations())
	rootCmd.AddCommand(outboxCmd())
}

func outboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "outbox",
		Short: "Inspect and repair the transactional outbox",
	}

	status := &cobra.Command{
		Use:   "status",
		Short: "Pending and failed events, oldest pending age, per topic",
		RunE:  runOutboxStatus,
	}
	addDatabaseFlag(status)
	status.Flags().Bool("json", false, "print one JSON object per topic, then the total (with the failed and retrying events as \"problems\")")
	status.Flags().Int("problems", 5, "list this many of the most recent failed events and of the longest-retrying ones, with their last error (0: none)")

	retryFailed := &cobra.Command{
		Use:   "retry-failed",
		Short: "Put failed events back to pending with a fresh retry budget",
		Long: `Puts the outbox rows in the failed state (those that exhausted their
publish attempts) back to pending with a fresh retry budget, and wakes the
relays. --topic and --id narrow the selection; --dry-run only lists it. On a
terminal it shows the selection and asks to confirm; elsewhere --yes is
required. Every run past flag validation is recorded in
millwright_audit (a dry run writes nothing else).
Progress (rows reset of those selected) goes to stderr.`,
		Args: cobra.NoArgs,
		RunE: runRetryFailed,
	}
	addDatabaseFlag(retryFailed)
	retryFailed.Flags().String("topic", "", "retry only this topic's failed events")
	retryFailed.Flags().Int64Slice("id", nil, "retry only these row ids (repeat or comma-separate)")
	retryFailed.Flags().Bool("dry-run", false, "list the events that would be retried; change nothing but the audit row")
	addSafetyFlags(retryFailed)

	cmd.AddCommand(status, retryFailed, cleanCmd("outbox"))
	cmd.AddCommand(outboxSwitchCmds()...)
	return cmd
}

// runOutboxStatus is `outbox status`.
func runOutboxStatus(cmd *cobra.Command, _ []string) error {
	pool, err := openPool(cmd)
	if err != nil {
		return err
	}
	defer pool.Close()
	ctx := cmd.Context()
	db := pool.handle()
	total, err := outbox.ReadStats(ctx, db)
	if err != nil {
		return err
	}
	topics, err := outbox.ReadTopicStats(ctx, db)
	if err != nil {
		return err
	}
	nProblems, _ := cmd.Flags().GetInt("problems")
	if nProblems < 0 {
		return fmt.Errorf("--problems %d: want 0 (none) or more", nProblems)
	}
	var problems []outbox.ProblemEvent
	if nProblems > 0 {
		if problems, err = outbox.ReadProblems(ctx, db, nProblems); err != nil {
			return err
		}
	}
	out := cmd.OutOrStdout()
	if asJSON, _ := cmd.Flags().GetBool("json"); asJSON {
		enc := json.NewEncoder(out)
		for _, t := range topics {
			if err := enc.Encode(map[string]any{"topic": t.Topic, "pending": t.Pending, "oldest_pending_age_seconds": t.OldestPendingAge.Seconds(), "failed": t.Failed}); err != nil {
				return err
			}
		}
		recent := make([]map[string]any, 0, len(problems))
		for _, p := range problems {
			recent = append(recent, map[string]any{"id": p.ID, "event_id": p.EventID, "topic": p.Topic, "aggregate_id": p.AggregateID,
				"status": problemStatus(p), "attempts": p.RetryCount, "last_error": p.LastError, "created_at": p.CreatedAt})
		}
		return enc.Encode(map[string]any{"topic": "*", "pending": total.Pending, "oldest_pending_age_seconds": total.OldestPendingAge.Seconds(), "failed": total.Failed, "problems": recent})
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TOPIC\tPENDING\tOLDEST PENDING\tFAILED")
	for _, t := range topics {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\n", t.Topic, t.Pending, t.OldestPendingAge.Round(time.Millisecond), t.Failed)
	}
	fmt.Fprintf(tw, "(all)\t%d\t%s\t%d\n", total.Pending, total.OldestPendingAge.Round(time.Millisecond), total.Failed)
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(problems) > 0 {
		fmt.Fprintf(out, "\nfailed and retrying events (the %d most recent failed, the %d with the most attempts):\n", nProblems, nProblems)
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSTATUS\tTOPIC\tEVENT ID\tATTEMPTS\tAGE\tLAST ERROR")
		now := time.Now()
		for _, p := range problems {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\n", p.ID, problemStatus(p), p.Topic, p.EventID, p.RetryCount,
				now.Sub(p.CreatedAt).Round(time.Second), oneLine(p.LastError, 160))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if total.Failed > 0 {
		fmt.Fprintln(out, "failed events wait for `millwright outbox retry-failed` (try --dry-run first)")
	}
	return nil
}

// runRetryFailed is `outbox retry-failed`.
func runRetryFailed(cmd *cobra.Command, args []string) error {
	topic, _ := cmd.Flags().GetString("topic")
	ids, _ := cmd.Flags().GetInt64Slice("id")
	dry, _ := cmd.Flags().GetBool("dry-run")
	change, pool, err := openChange(cmd, args)
	if err != nil {
		return err
	}
	defer pool.Close()
	filter := outbox.FailedFilter{Topic: topic, IDs: ids}
	err = change.confirm(func() (string, error) {
		evs, err := retryFailedOn(cmd.Context(), pool, filter, true, nil)
		if err != nil {
			return "", err
		}
		var b strings.Builder
		printFailedEvents(&b, evs)
		fmt.Fprintf(&b, "%d failed event(s) will go back to pending", len(evs))
		return firstLines(b.String(), 20), nil
	})
	if err != nil {
		return err
	}
	evs, err := retryFailed(cmd, pool, filter, dry)
	if err != nil {
		return change.finish(0, err)
	}
	out := cmd.OutOrStdout()
	if err := printFailedEvents(out, evs); err != nil {
		return change.finish(int64(len(evs)), err)
	}
	if dry {
		fmt.Fprintf(out, "dry run: %d failed event(s) would be retried\n", len(evs))
	} else {
		fmt.Fprintf(out, "%d failed event(s) back to pending\n", len(evs))
	}
	return change.finish(int64(len(evs)), nil)
}

// problemStatus names a ProblemEvent's state in `outbox status`.
func problemStatus(p outbox.ProblemEvent) string {
	if p.Failed {
		return "failed"
	}
	return "retrying"
}

// printFailedEvents lists failed outbox events as a table.
func printFailedEvents(out io.Writer, evs []outbox.FailedEvent) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tEVENT ID\tTOPIC\tAGGREGATE\tATTEMPTS\tLAST ERROR")
	for _, e := range evs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\n", e.ID, e.EventID, e.Topic, e.AggregateID, e.RetryCount, oneLine(e.LastError, 80))
	}
	return tw.Flush()
}

func oneLine(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		return s[:n-3] + "..."
	}
	return s
}
