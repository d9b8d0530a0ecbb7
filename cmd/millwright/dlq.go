package main

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
)

func init() {
	registerMigrations(dlq.Migrations())
	rootCmd.AddCommand(dlqCmd())
}

func dlqCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "Inspect and replay dead letters stored in millwright_dead_letters",
		Long: `Dead letters are messages the dlq middleware parked on a dead-letter topic;
dlq.Store.Record, consuming those topics, stores them in Postgres. These
commands read that table and replay rows to their original topic (or another).`,
	}
	cmd.AddCommand(dlqListCmd(), dlqShowCmd(), dlqReplayCmd(), dlqGroupsCmd(), cleanCmd("dlq"))
	return cmd
}

// dlqStore is the dead-letter store on the command's pool (--driver).
func dlqStore(pool *cliPool) *dlq.Store {
	return dlq.NewStore(pool.handle())
}

// addDLQFilterFlags adds the row selection flags shared by list and replay.
func addDLQFilterFlags(cmd *cobra.Command, defaultLimit int) {
	f := cmd.Flags()
	f.String("topic", "", "only dead letters from this original topic")
	f.String("since", "", "only dead letters whose last failure is at or after this time (RFC 3339, or a duration such as 24h meaning that long ago)")
	f.String("until", "", "only dead letters whose last failure is before this time (RFC 3339 or a duration ago)")
	f.String("error", "", "only dead letters whose error contains this text (case-insensitive)")
	f.Int("limit", defaultLimit, "at most this many rows, oldest first (0: no limit)")
	f.Int64Slice("id", nil, "only these row ids (repeat or comma-separate)")
	addDatabaseFlag(cmd)
}

func dlqFilterFromFlags(cmd *cobra.Command) (dlq.Filter, error) {
	var f dlq.Filter
	fl := cmd.Flags()
	f.Topic, _ = fl.GetString("topic")
	f.ErrorContains, _ = fl.GetString("error")
	f.Limit, _ = fl.GetInt("limit")
	f.IDs, _ = fl.GetInt64Slice("id")
	if f.Limit < 0 {
		return f, fmt.Errorf("--limit %d: want >= 0 (0 means no limit)", f.Limit)
	}
	var err error
	since, _ := fl.GetString("since")
	if f.Since, err = dlqParseWhen(since, "--since"); err != nil {
		return f, err
	}
	until, _ := fl.GetString("until")
	if f.Until, err = dlqParseWhen(until, "--until"); err != nil {
		return f, err
	}
	return f, nil
}

// dlqParseWhen reads an RFC 3339 time or a duration meaning that long ago.
func dlqParseWhen(s, flag string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		return time.Now().Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%s %q: want an RFC 3339 time (2026-01-02T15:04:05Z) or a duration ago (24h, 90m)", flag, s)
}

func dlqListCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List dead letters, oldest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f, err := dlqFilterFromFlags(cmd)
			if err != nil {
				return err
			}
			f.Pending, _ = cmd.Flags().GetBool("pending")
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			rows, err := dlqStore(pool).List(cmd.Context(), f)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if len(rows) == 0 {
				fmt.Fprintln(out, "no dead letters match")
				return nil
			}
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tLAST FAILURE\tTOPIC\tREASON\tATTEMPTS\tSTATE\tREPLAYED\tMESSAGE\tERROR")
			for _, d := range rows {
				replayed := "-"
				if d.ReplayedAt != nil {
					replayed = fmt.Sprintf("%dx %s", d.ReplayCount, d.ReplayedAt.UTC().Format(time.RFC3339))
				}
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", d.ID, d.LastFailure.UTC().Format(time.RFC3339),
					d.OriginalTopic, d.Reason, d.Attempts, d.State, replayed, dlq.Printable(d.MessageUUID), dlqOneLine(d.Error, 80))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if f.Limit > 0 && len(rows) == f.Limit {
				fmt.Fprintf(out, "(first %d rows; narrow the filters or pass --limit 0 for all)\n", f.Limit)
			}
			return nil
		},
	}
	addDLQFilterFlags(cmd, 50)
	cmd.Flags().Bool("pending", false, "only dead letters still dead: never replayed, superseded by an edit, nor resolved (applied later through park)")
	return cmd
}

// dlqOneLine shortens s to one line of at most n runes.
func dlqOneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}

func dlqShowCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show ID",
		Short: "Show one dead letter: its failure, metadata, payload and stack",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id, err := strconv.ParseInt(args[0], 10, 64)
			if err != nil {
				return fmt.Errorf("dead letter id %q is not a number: see the ID column of `millwright dlq list`", args[0])
			}
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			d, err := dlqStore(pool).Get(cmd.Context(), id)
			if err != nil {
				return err
			}
			printDLQDeadLetter(cmd.OutOrStdout(), d)
			return nil
		},
	}
	addDatabaseFlag(cmd)
	return cmd
}

func printDLQDeadLetter(out io.Writer, d dlq.DeadLetter) {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	row := func(k string, v any) { fmt.Fprintf(w, "%s:\t%v\n", k, v) }
	row("id", d.ID)
	row("message uuid", dlq.Printable(d.MessageUUID))
	row("original topic", d.OriginalTopic)
	row("dead-letter topic", d.DeadLetterTopic)
	row("consumer group", d.ConsumerGroup)
	row("handler", d.Handler)
	row("reason", d.Reason)
	row("error", d.Error)
	row("error type", d.ErrorType)
	row("attempts", d.Attempts)
	row("first failure", d.FirstFailure.UTC().Format(time.RFC3339Nano))
	row("last failure", d.LastFailure.UTC().Format(time.RFC3339Nano))
	row("recorded", d.CreatedAt.UTC().Format(time.RFC3339Nano))
	row("state", d.State)
	if d.ReplayedAt != nil {
		row("replayed", fmt.Sprintf("%d times, last %s", d.ReplayCount, d.ReplayedAt.UTC().Format(time.RFC3339Nano)))
	} else {
		row("replayed", "never")
	}
	_ = w.Flush()
	fmt.Fprintln(out, "metadata:")
	keys := make([]string, 0, len(d.Metadata))
	for k := range d.Metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Fprintf(out, "  %s: %s\n", dlq.Printable(k), dlq.Printable(d.Metadata[k]))
	}
	if utf8.Valid(d.Payload) {
		fmt.Fprintf(out, "payload (%d bytes):\n%s\n", len(d.Payload), d.Payload)
	} else {
		fmt.Fprintf(out, "payload (%d bytes, binary, hex dump):\n%s", len(d.Payload), hex.Dump(d.Payload))
	}
	if d.Stack != "" {
		fmt.Fprintf(out, "stack:\n%s\n", d.Stack)
	}
}

func dlqReplayCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Replay dead letters through the outbox to their original topic (or --target)",
		Long: `Replay the selected dead letters, oldest first, to their original topic (or
--target) with their original event id, payload and metadata: each is
queued in the outbox (millwright_outbox) and its row marked replayed in one
transaction, with an audit row, and a relay publishes it: exactly once.
This is the replay the operator console runs (dlq.ReplayTx). The outbox
tables must be in the schema (millwright migrate), and a relay must run on
it (millwright relay, or the service's own) for the replays to reach the
broker; the command says how many it queued and whether a relay is alive.

Rows already replayed are skipped unless --force. --dry-run prints exactly
which message would go to which topic and queues and marks nothing. At
least one filter flag, or --all, is required, so a bare command cannot
replay everything by accident. On a terminal it shows the selection and
asks to confirm; elsewhere --yes is required. Every run past flag
validation is recorded in millwright_audit (a dry run writes nothing else),
and every replayed dead letter gets its own audit row ("dlq replay") in
its transaction. Progress (messages queued of those selected) goes to
stderr; an interrupted replay says how far it got, and re-running it
continues with the rest (without --force).

Every consumer group on the topic receives a replay, but it is for the
consumer that gave up on it (its consumer group and handler, printed as
"for consumer <group>/<handler> only"): the others ack it without running
their handler. A dead letter that records no consumer (older rows), or a
replay to --target, goes to every consumer of the topic; the output warns
about the first kind before anything is queued. --for names another
consumer (the new name of a renamed consumer group or handler, which its
old dead letters no longer match: every group would skip them), or '*'
for every consumer group.

A dead letter whose message UUID or metadata is not text (a binary Kafka
key or header) cannot be carried by the outbox and is refused, naming it.`,
		Args: cobra.NoArgs,
		RunE: runDLQReplay,
	}
	addDLQFilterFlags(cmd, 0)
	f := cmd.Flags()
	f.Bool("dry-run", false, "print what would be queued where; queue and mark nothing (writes only the audit row)")
	f.Float64("rate", 10, "queue at most this many messages per second (0: unlimited)")
	f.String("target", "", "replay to this topic instead of each dead letter's original topic")
	f.Bool("force", false, "also replay dead letters replayed before")
	f.String("for", "", "the consumer the replays are for, as <consumer group>/<handler> (a renamed group or handler), or '*' for every consumer group on the topic (default: the consumer each dead letter records)")
	f.Bool("all", false, "replay every dead letter the other flags allow (required when no filter is given)")
	f.String("transport", "", "ignored: replays go through the outbox and the relay publishes them (kept so that older scripts still run)")
	_ = f.MarkDeprecated("transport", "replays go through the outbox; the relay publishes them with its transport")
	addSafetyFlags(cmd)
	return cmd
}

func runDLQReplay(cmd *cobra.Command, args []string) error {
	filter, err := dlqFilterFromFlags(cmd)
	if err != nil {
		return err
	}
	fl := cmd.Flags()
	var opts dlq.ReplayOptions
	opts.Filter = filter
	opts.DryRun, _ = fl.GetBool("dry-run")
	opts.Rate, _ = fl.GetFloat64("rate")
	opts.Target, _ = fl.GetString("target")
	opts.Force, _ = fl.GetBool("force")
	opts.For, _ = fl.GetString("for")
	all, _ := fl.GetBool("all")
	filtered := false
	for _, name := range []string{"topic", "since", "until", "error", "id", "limit"} {
		filtered = filtered || fl.Changed(name)
	}
	if !filtered && !all {
		return errors.New("dlq replay: no filter given: pass --topic, --since, --until, --error, --id or --limit, or --all to replay every dead letter")
	}
	if opts.Rate < 0 {
		return fmt.Errorf("--rate %v: want >= 0 (0 means unlimited)", opts.Rate)
	}
	change, pool, err := openChange(cmd, args)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := pool.handle()
	out := cmd.OutOrStdout()

	if opts.DryRun {
		rep, err := dlq.Replay(cmd.Context(), db, opts)
		printDLQReplay(out, rep)
		return change.finish(int64(len(rep.Items)), err)
	}
	err = change.confirm(func() (string, error) {
		preview := opts
		preview.DryRun = true
		rep, err := dlq.Replay(cmd.Context(), db, preview)
		if err != nil {
			return "", err
		}
		var b strings.Builder
		printDLQReplay(&b, rep)
		return firstLines(b.String(), 20), nil
	})
	if err != nil {
		return err
	}
	opts.By = audit.Operator{User: audit.CurrentUser(), Host: audit.Hostname(), Confirmed: change.confirmed}
	return queueDLQReplay(cmd, change, db, opts)
}

// queueDLQReplay is the confirmed run of `dlq replay`: it queues the
// selection through the outbox (dlq.Replay), reporting progress, says
// whether a relay will publish it, and audits the run.
func queueDLQReplay(cmd *cobra.Command, change *change, db postgres.DB, opts dlq.ReplayOptions) error {
	total, err := dlq.CountReplay(cmd.Context(), db, opts)
	if err != nil {
		return change.finish(0, err)
	}
	prog := newProgress(cmd, "dlq replay", "messages", int64(total))
	opts.Progress = func(n int) { prog.Set(int64(n)) }
	rep, err := dlq.Replay(cmd.Context(), db, opts)
	printDLQReplay(cmd.OutOrStdout(), rep)
	if err != nil && cmd.Context().Err() != nil {
		// The audit row and main's line say what stopped it.
		err = fmt.Errorf("dlq replay interrupted after queueing %d: %w", len(rep.Items), stoppedBy(cmd.Context(), err))
	}
	if len(rep.Items) > 0 {
		fmt.Fprintln(cmd.ErrOrStderr(), dlqRelayNote(cmd, db))
	}
	// Last, so that it is the line an operator sees.
	if err != nil {
		prog.Stopped(stoppedBy(cmd.Context(), err), dlqReplayResume(opts, len(rep.Items)))
	} else {
		prog.Finish(fmt.Sprintf("%d queued", len(rep.Items)))
	}
	return change.finish(int64(len(rep.Items)), err)
}

// dlqRelayNote tells the operator who publishes the queued replays: the
// relays that announce themselves live on this outbox, or a warning that
// none does (the replays wait in the outbox until one runs).
func dlqRelayNote(cmd *cobra.Command, db postgres.DB) string {
	live, err := outbox.LiveRelays(cmd.Context(), db)
	switch {
	case err != nil:
		return fmt.Sprintf("note: the replays are queued in the outbox; could not check for a relay (%v): run `millwright outbox status` to see them publish", err)
	case live == 0:
		return "warning: the replays are queued in the outbox, but no relay is running on it: they reach the broker once one runs (`millwright relay`, or the service's own)"
	}
	return fmt.Sprintf("the replays are queued in the outbox; %d live relay(s) publish them (`millwright outbox status` shows the backlog)", live)
}

// dlqReplayResume says what re-running a replay that stopped after
// queueing n messages does: each queued row was marked replayed in the
// transaction that queued it, so without --force the same command skips
// them and continues with the rest; with --force it would queue them again.
func dlqReplayResume(opts dlq.ReplayOptions, n int) string {
	if opts.Force {
		return fmt.Sprintf("re-running with --force would queue the %d above again: narrow the selection (--id, --since) to continue with the rest", n)
	}
	return fmt.Sprintf("re-running the same command continues safely: the %d queued are marked replayed and skipped", n)
}

func printDLQReplay(out io.Writer, rep dlq.ReplayReport) {
	verb := "queued"
	if rep.DryRun {
		verb = "would queue"
	}
	// First, so that the confirmation prompt (the first lines) shows it.
	if n := dlqUntargeted(rep); n > 0 {
		fmt.Fprintf(out, "warning: %d replay(s) below name no consumer (the dead letter records none, or --for '*'): every consumer group on the topic receives the replay and runs it, and a group that applied the original applies it again unless it still holds its idempotency mark (kept %s by default; dead letters %s)\n",
			n, dlqDays(retention.DefaultIdempotencyRetention), dlqDays(retention.DefaultDeadLetterRetention))
	}
	for _, it := range rep.Items {
		line := fmt.Sprintf("%s dead letter %d (message %s) from %s to %s", verb, it.ID, dlq.Printable(it.MessageUUID), it.From, it.To)
		switch {
		case it.For != "":
			line += " for consumer " + it.For + " only"
		case it.To == it.From:
			line += " for every consumer group"
		}
		fmt.Fprintln(out, line)
	}
	summary := fmt.Sprintf("%s %d message(s)", verb, len(rep.Items))
	if rep.SkippedReplayed > 0 {
		summary += fmt.Sprintf("; skipped %d already replayed or resolved (use --force to replay them again)", rep.SkippedReplayed)
	}
	if rep.SkippedConcurrent > 0 {
		summary += fmt.Sprintf("; skipped %d taken by a concurrent replay", rep.SkippedConcurrent)
	}
	if rep.DryRun {
		summary += " (dry run: nothing queued, nothing marked)"
	}
	fmt.Fprintln(out, summary)
}

// dlqUntargeted counts the replays of rep that go to their original topic
// without naming a consumer (ReplayItem.For ""): every consumer group on
// the topic runs them.
func dlqUntargeted(rep dlq.ReplayReport) int {
	n := 0
	for _, it := range rep.Items {
		if it.For == "" && it.To == it.From {
			n++
		}
	}
	return n
}

// dlqDays renders a retention in days.
func dlqDays(d time.Duration) string { return fmt.Sprintf("%d days", int(d/(24*time.Hour))) }
