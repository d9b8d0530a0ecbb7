package main

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/millwright/millwright/park"
)

func init() {
	registerMigrations(park.Migrations())
	rootCmd.AddCommand(parkedCmd())
}

func parkedCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "parked",
		Short: "Inspect, retry and release parked keys (millwright_parked_keys)",
		Long: `A key is parked when one of its messages failed past its handler's in-place
retries (package park): that message and the key's later ones wait in
Postgres for the retrier, while the partition goes on with other keys.
A key is held when its head was dead-lettered under park.Hold: nothing of it
runs until an operator retries it (the head again, then the rest) or
releases it (the head stays in the DLQ; the rest goes on).`,
	}
	cmd.AddCommand(parkedListCmd(), parkedChangeCmd("retry"), parkedChangeCmd("release"))
	return cmd
}

func parkStore(pool *cliPool) *park.Store {
	return onPool(pool, park.NewStore[*sql.DB], park.NewStore[*pgxpool.Pool])
}

// parkedRow is one key of `parked list --json`.
type parkedRow struct {
	Handler      string     `json:"handler"`
	Key          string     `json:"key"`
	Messages     int64      `json:"messages"`
	Held         bool       `json:"held"`
	DueAt        *time.Time `json:"due_at,omitempty"`
	Attempts     int        `json:"attempts"`
	Rounds       int        `json:"rounds"`
	FirstFailure *time.Time `json:"first_failure,omitempty"`
	LastFailure  *time.Time `json:"last_failure,omitempty"`
	LastError    string     `json:"last_error"`
	DeadLetterID int64      `json:"dead_letter_id,omitempty"`
	ParkedSince  time.Time  `json:"parked_since"`
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC()
	return &t
}

func parkedListCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List parked keys: held ones first, then by due time",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			handler, _ := cmd.Flags().GetString("handler")
			limit, _ := cmd.Flags().GetInt("limit")
			asJSON, _ := cmd.Flags().GetBool("json")
			if limit < 0 {
				return fmt.Errorf("--limit %d: want >= 0 (0 means no limit)", limit)
			}
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			keys, err := parkStore(pool).List(cmd.Context(), park.Filter{Handler: handler, Limit: limit})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				for _, k := range keys {
					r := parkedRow{Handler: k.Handler, Key: k.Key, Messages: k.Messages, Held: k.Held, Attempts: k.Attempts, Rounds: k.Rounds,
						FirstFailure: timePtr(k.FirstFailure), LastFailure: timePtr(k.LastFailure), LastError: k.LastError,
						DeadLetterID: k.DeadLetterID, ParkedSince: k.ParkedSince.UTC()}
					if !k.Held {
						r.DueAt = timePtr(k.DueAt)
					}
					if err := enc.Encode(r); err != nil {
						return err
					}
				}
				return nil
			}
			if len(keys) == 0 {
				fmt.Fprintln(out, "no parked keys")
				return nil
			}
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "HANDLER\tKEY\tMESSAGES\tHEAD DUE\tATTEMPTS\tPARKED SINCE\tLAST ERROR")
			for _, k := range keys {
				due := k.DueAt.UTC().Format(time.RFC3339)
				if k.Held {
					due = fmt.Sprintf("held (dead letter %d)", k.DeadLetterID)
				}
				fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%d\t%s\t%s\n", k.Handler, k.Key, k.Messages, due, k.Attempts,
					k.ParkedSince.UTC().Format(time.RFC3339), dlqOneLine(k.LastError, 80))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if limit > 0 && len(keys) == limit {
				fmt.Fprintf(out, "(first %d keys; pass --handler or --limit 0 for all)\n", limit)
			}
			return nil
		},
	}
	cmd.Flags().String("handler", "", "only this handler's keys (the name given to park's Middleware)")
	cmd.Flags().Int("limit", 100, "at most this many keys (0: no limit)")
	cmd.Flags().Bool("json", false, "print one JSON object per key instead of the table")
	addDatabaseFlag(cmd)
	return cmd
}

var parkedChanges = map[string]struct{ short, long, does string }{
	"retry": {
		short: "Run a parked key's head again now, with a fresh budget (held or not)",
		long: `Once the cause of a parked key's failures is fixed, make its head message due
at once with a fresh park budget; a held key is un-held. A running retrier of
the key's handler runs it within its poll interval, then the key's later
messages in order.`,
		does: "run the head of %s again now, with a fresh budget, then its %d later message(s)",
	},
	"release": {
		short: "Drop a held key's dead-lettered head and go on with its later messages",
		long: `A held key's head was dead-lettered (it stays in millwright_dead_letters for
` + "`millwright dlq replay`" + `). Release drops it from the key, so the key's next message is
due at once (or the key is released when none is left). The dead letter,
replayed later, is applied after the key's later messages: out of order.
--force also drops the head of a key that is not held: a message that never
reached the DLQ, which is then lost.`,
		does: "drop the head of %s and go on with its %d later message(s)",
	},
}

func parkedChangeCmd(action string) *cobra.Command {
	c := parkedChanges[action]
	cmd := &cobra.Command{
		Use:   action + " KEY",
		Short: c.short,
		Long: c.long + `

--dry-run prints what would be done and writes only its audit row. On a
terminal it asks to confirm; elsewhere --yes is required. Every run past flag
validation is recorded in millwright_audit.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error { return runParkedChange(cmd, args, action) },
	}
	cmd.Flags().String("handler", "", "the key's handler; needed when several handlers have the key parked")
	if action == "release" {
		cmd.Flags().Bool("force", false, "also drop the head of a key that is not held (it never reached the DLQ: it is lost)")
	}
	cmd.Flags().Bool("dry-run", false, "print what would be done; change nothing but the audit row")
	addSafetyFlags(cmd)
	addDatabaseFlag(cmd)
	return cmd
}

func runParkedChange(cmd *cobra.Command, args []string, action string) error {
	handler, _ := cmd.Flags().GetString("handler")
	force, _ := cmd.Flags().GetBool("force")
	dry, _ := cmd.Flags().GetBool("dry-run")
	change, pool, err := openChange(cmd, args)
	if err != nil {
		return err
	}
	defer pool.Close()
	ctx, store, key := cmd.Context(), parkStore(pool), args[0]
	describe := func() (park.Key, string, error) {
		k, err := findParked(cmd, store, handler, key)
		if err != nil {
			return k, "", err
		}
		if action == "release" && !k.Held && !force {
			return k, "", fmt.Errorf("parked release: key %q of handler %q is not held (its head is still being retried, not in the DLQ); wait, use `millwright parked retry`, or pass --force to drop it", key, k.Handler)
		}
		name := fmt.Sprintf("key %q of handler %q", k.Key, k.Handler)
		return k, fmt.Sprintf(parkedChanges[action].does, name, max(k.Messages-1, 0)), nil
	}
	k, what, err := describe()
	if err != nil {
		return change.finish(0, err)
	}
	if dry {
		fmt.Fprintf(cmd.OutOrStdout(), "dry run: would %s\n", what)
		return change.finish(1, nil)
	}
	if err := change.confirm(func() (string, error) { return "will " + what, nil }); err != nil {
		return err
	}
	if action == "retry" {
		err = store.Retry(ctx, k.Handler, k.Key)
	} else {
		err = store.Release(ctx, k.Handler, k.Key, force)
	}
	if err != nil {
		return change.finish(0, err)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "done: %s; a running retrier of handler %q acts within its poll interval\n", what, k.Handler)
	return change.finish(1, nil)
}

// findParked finds key among the parked keys of handler (of any handler
// when ""), which must name one.
func findParked(cmd *cobra.Command, store *park.Store, handler, key string) (park.Key, error) {
	found, err := store.List(cmd.Context(), park.Filter{Handler: handler, Key: key})
	if err != nil {
		return park.Key{}, err
	}
	switch len(found) {
	case 1:
		return found[0], nil
	case 0:
		where := "any handler"
		if handler != "" {
			where = fmt.Sprintf("handler %q", handler)
		}
		return park.Key{}, fmt.Errorf("%s: key %q is not parked for %s (see `millwright parked list`): %w", cmd.CommandPath(), key, where, park.ErrNotParked)
	}
	names := make([]string, len(found))
	for i, k := range found {
		names[i] = k.Handler
	}
	return park.Key{}, fmt.Errorf("%s: key %q is parked for several handlers (%s): pass --handler", cmd.CommandPath(), key, strings.Join(names, ", "))
}
