package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/saga"
)

func init() {
	registerMigrations(saga.Migrations())
	rootCmd.AddCommand(sagaCmd())
}

func sagaCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "saga",
		Short: "Inspect saga instances and resolve stuck ones",
		Long: `Saga instances live in millwright_saga_instances, their step history in
millwright_saga_steps. These commands read them and hand stuck sagas back to
the orchestrators. A saga type's state diagram comes from its Go definition:
print Definition.Mermaid().`,
	}
	cmd.AddCommand(sagaListCmd(), sagaShowCmd(), sagaResolveCmd(), cleanCmd("saga"))
	return cmd
}

func sagaListCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List saga instances, newest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var f saga.Filter
			f.Type, _ = cmd.Flags().GetString("type")
			state, _ := cmd.Flags().GetString("state")
			f.State = saga.State(state)
			f.Limit, _ = cmd.Flags().GetInt("limit")
			switch f.State {
			case "", saga.StateRunning, saga.StateCompensating, saga.StateCompleted, saga.StateCompensated, saga.StateStuck:
			default:
				return fmt.Errorf("--state %q: want running, compensating, completed, compensated or stuck", state)
			}
			if f.Limit < 0 {
				return fmt.Errorf("--limit %d: want >= 0 (0 means no limit)", f.Limit)
			}
			if f.Limit == 0 {
				f.Limit = -1
			}
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			rows, err := saga.List(cmd.Context(), pool.handle(), f)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if len(rows) == 0 {
				fmt.Fprintln(out, "no sagas match")
				return nil
			}
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tTYPE\tSTATE\tSTEP\tVERSION\tCREATED\tUPDATED\tLAST ERROR")
			for _, in := range rows {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", in.ID, in.Type, in.State, dash(in.Step), in.Version,
					in.CreatedAt.UTC().Format(time.RFC3339), in.UpdatedAt.UTC().Format(time.RFC3339), dash(oneLine(in.LastError, 80)))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if f.Limit > 0 && len(rows) == f.Limit {
				fmt.Fprintf(out, "(first %d rows; narrow with --type/--state or pass --limit 0 for all)\n", f.Limit)
			}
			return nil
		},
	}
	cmd.Flags().String("type", "", "only sagas of this type (definition name)")
	cmd.Flags().String("state", "", "only sagas in this state: running, compensating, completed, compensated, stuck")
	cmd.Flags().Int("limit", 50, "at most this many rows, newest first (0: no limit)")
	addDatabaseFlag(cmd)
	return cmd
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func sagaShowCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show ID",
		Short: "Show a saga instance, its data and its step history with times and errors",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			in, hist, err := saga.Get(cmd.Context(), pool.handle(), args[0])
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintf(w, "id:\t%s\n", in.ID)
			fmt.Fprintf(w, "type:\t%s\n", in.Type)
			fmt.Fprintf(w, "state:\t%s\n", in.State)
			fmt.Fprintf(w, "step:\t%s\n", dash(in.Step))
			if len(in.Branches) > 0 {
				fmt.Fprintf(w, "branches:\t%s\n", branchesLine(in.Branches))
			}
			fmt.Fprintf(w, "version:\t%d\n", in.Version)
			fmt.Fprintf(w, "created:\t%s\n", in.CreatedAt.UTC().Format(time.RFC3339Nano))
			fmt.Fprintf(w, "updated:\t%s\n", in.UpdatedAt.UTC().Format(time.RFC3339Nano))
			if !in.Deadline.IsZero() {
				what := "reply due"
				if !in.AwaitingReply {
					what = "next compensation attempt"
				}
				fmt.Fprintf(w, "deadline:\t%s (%s)\n", in.Deadline.UTC().Format(time.RFC3339Nano), what)
			}
			if in.CompensationAttempts > 0 {
				fmt.Fprintf(w, "compensation attempts:\t%d\n", in.CompensationAttempts)
			}
			fmt.Fprintf(w, "last error:\t%s\n", dash(in.LastError))
			fmt.Fprintf(w, "data:\t%s\n", in.Data)
			if err := w.Flush(); err != nil {
				return err
			}
			fmt.Fprintf(out, "\nhistory (%d entries):\n", len(hist))
			w = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "TIME\t+MS\tSTEP\tKIND\tDETAIL\tATTEMPT\tERROR")
			for _, h := range hist {
				fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%d\t%s\n", h.At.UTC().Format("2006-01-02T15:04:05.000Z"),
					h.At.Sub(in.CreatedAt).Milliseconds(), dash(h.Step), h.Kind, dash(h.Detail), h.Attempt, dash(oneLine(h.Error, 100)))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if in.State == saga.StateStuck {
				fmt.Fprintf(out, "\nstuck: fix the participant, then `millwright saga resolve %s` (retry) or `--action skip` if compensated by hand\n", in.ID)
			}
			return nil
		},
	}
	addDatabaseFlag(cmd)
	return cmd
}

func sagaResolveCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "resolve ID",
		Short: "Hand a stuck saga back to the orchestrators (retry its compensation, or skip it)",
		Long: `A saga is stuck when a compensation spent its retry budget. Once the
participant is fixed:

  --action retry  sends the stuck compensation again with a fresh budget;
  --action skip   records it as done by hand and continues with the
                  compensations of the earlier steps.

A saga is also stuck when a Retriable step's command spent its retry
budget: retry then sends that command again with a fresh budget, and skip
records the step as done by hand and goes on with the next step.

The next round of any running orchestrator of the saga's type acts on it.
--dry-run prints what would be done and writes only its audit row. On a
terminal it shows the resolution and asks to confirm; elsewhere --yes is
required. Every run past flag validation is recorded in millwright_audit.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			action, _ := cmd.Flags().GetString("action")
			note, _ := cmd.Flags().GetString("note")
			dry, _ := cmd.Flags().GetBool("dry-run")
			if a := saga.ResolveAction(action); a != saga.ResolveRetry && a != saga.ResolveSkip {
				return fmt.Errorf("saga resolve: --action: unknown action %q: want %s (send the stuck compensation again) or %s (it was done by hand)", action, saga.ResolveRetry, saga.ResolveSkip)
			}
			change, pool, err := openChange(cmd, args)
			if err != nil {
				return err
			}
			defer pool.Close()
			ctx := cmd.Context()
			out := cmd.OutOrStdout()
			resolve := func(dryRun bool) (saga.Resolution, error) {
				return resolveSaga(ctx, pool, args[0], saga.ResolveAction(action), note, dryRun)
			}
			if dry {
				r, err := resolve(true)
				if err != nil {
					return change.finish(0, err)
				}
				fmt.Fprintf(out, "dry run: would %s (saga %s, type %s)\n", r.Description, r.Info.ID, r.Info.Type)
				return change.finish(1, nil)
			}
			err = change.confirm(func() (string, error) {
				r, err := resolve(true)
				if err != nil {
					return "", err
				}
				return fmt.Sprintf("will %s (saga %s, type %s)", r.Description, r.Info.ID, r.Info.Type), nil
			})
			if err != nil {
				return err
			}
			r, err := resolve(false)
			if err != nil {
				return change.finish(0, err)
			}
			fmt.Fprintf(out, "resolved saga %s (type %s): will %s; a running orchestrator of type %s acts on it within its poll interval\n",
				r.Info.ID, r.Info.Type, r.Description, r.Info.Type)
			return change.finish(1, nil)
		},
	}
	cmd.Flags().String("action", string(saga.ResolveRetry), "retry (send the stuck compensation again) or skip (it was done by hand)")
	cmd.Flags().String("note", "", "recorded in the saga's history with the action")
	cmd.Flags().Bool("dry-run", false, "print what would be done; change nothing but the audit row")
	addSafetyFlags(cmd)
	addDatabaseFlag(cmd)
	return cmd
}

// resolveSaga is saga.Resolve on the command's pool (--driver).
func resolveSaga(ctx context.Context, pool *cliPool, id string, action saga.ResolveAction, note string, dryRun bool) (saga.Resolution, error) {
	return saga.Resolve(ctx, pool.handle(), id, action, note, dryRun)
}

// branchesLine is a saga's parallel branches for `saga show`, by name:
// "charge=succeeded, ship=running (due 2026-...)".
func branchesLine(bs map[string]saga.BranchInfo) string {
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(bs)) {
		b := bs[name]
		p := name + "=" + b.State
		if b.State == saga.BranchRunning && !b.Deadline.IsZero() {
			p += " (due " + b.Deadline.UTC().Format(time.RFC3339Nano) + ")"
		}
		if b.LateSuccess {
			p += " (succeeded late)"
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, ", ")
}
