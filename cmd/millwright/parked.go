package main

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

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
	cmd.AddCommand(parkedListCmd(), parkedChangeCmd("retry"), parkedChangeCmd("release"), parkedChangeCmd("skip"))
	return cmd
}

func parkStore(pool *cliPool) *park.Store {
	return park.NewStore(pool.handle())
}

// parkedRow is one key of `parked list --json`.
type parkedRow struct {
	Handler string `json:"handler"`
	// Key is the key as text; a key that is not UTF-8 text has KeyHex
	// (its bytes, hex) instead, a lane without a key Keyless and the
	// message's UUID as Key.
	Key          string     `json:"key,omitempty"`
	KeyHex       string     `json:"key_hex,omitempty"`
	Keyless      bool       `json:"keyless,omitempty"`
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
					r := parkedRow{Handler: k.Handler, Key: k.Key, Keyless: k.Keyless, Messages: k.Messages, Held: k.Held, Attempts: k.Attempts, Rounds: k.Rounds,
						FirstFailure: timePtr(k.FirstFailure), LastFailure: timePtr(k.LastFailure), LastError: k.LastError,
						DeadLetterID: k.DeadLetterID, ParkedSince: k.ParkedSince.UTC()}
					if !k.Held {
						r.DueAt = timePtr(k.DueAt)
					}
					if !textKey(k.Key) {
						r.Key, r.KeyHex = "", hex.EncodeToString([]byte(k.Key))
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
				fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%d\t%s\t%s\n", k.Handler, shownKey(k), k.Messages, due, k.Attempts,
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

// textKey reports whether key shows as itself: UTF-8 text without control
// characters (tabs and newlines would break the table).
func textKey(key string) bool {
	if !utf8.ValidString(key) {
		return false
	}
	for _, r := range key {
		if unicode.IsControl(r) {
			return false
		}
	}
	return true
}

// shownKey is k's key as the table shows it and the KEY argument takes it
// back: the text, "hex:<bytes>" (with --hex) for a binary key, "(no key)
// <UUID>" (with --no-key) for a message parked without a key.
func shownKey(k park.Key) string {
	switch {
	case k.Keyless:
		return "(no key) " + k.Key
	case textKey(k.Key):
		return k.Key
	}
	return "hex:" + hex.EncodeToString([]byte(k.Key))
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
reached the DLQ, which is then lost (` + "`millwright parked skip`" + ` keeps it in the DLQ).`,
		does: "drop the head of %s and go on with its %d later message(s)",
	},
	"skip": {
		short: "Dead-letter a parked key's head (if it is not yet) and go on with its later messages",
		long: `Skip is release that never loses the head: a head still being retried (the key
is not held) is first recorded in millwright_dead_letters (reason skipped,
with the key's attempts and last error), then dropped from the key, so the
key's next message is due at once; a held key's head is already a dead
letter and is dropped as release does. The dead letter can be replayed
later (` + "`millwright dlq replay --id`" + `), after the key's later messages: out of order.
--consumer-group names the handler's consumer group (park.Config.ConsumerGroup)
on the dead letter, so that its replay is for that consumer only; without
it the replay goes to every consumer group of the topic.`,
		does: "dead-letter the head of %s (unless it is already) and go on with its %d later message(s)",
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
	cmd.Flags().Bool("hex", false, "KEY is the key's bytes in hex (a binary key, shown as hex:... by `parked list`)")
	cmd.Flags().Bool("no-key", false, "KEY is the UUID of a message parked without a key (shown as (no key) UUID by `parked list`)")
	if action == "release" {
		cmd.Flags().Bool("force", false, "also drop the head of a key that is not held (it never reached the DLQ: it is lost; `parked skip` keeps it)")
	}
	if action == "skip" {
		cmd.Flags().String("consumer-group", "", "the handler's consumer group, recorded on the dead letter so that its replay is for that consumer (default: none, every consumer group runs the replay)")
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
	ctx, store := cmd.Context(), parkStore(pool)
	key, keyless, err := keyArg(cmd, args[0])
	if err != nil {
		return change.finish(0, err)
	}
	describe := func() (park.Key, string, error) {
		k, err := findParked(cmd, store, handler, key, keyless)
		if err != nil {
			return k, "", err
		}
		if action == "release" && !k.Held && !force {
			return k, "", fmt.Errorf("parked release: %s is not held (its head is still being retried, not in the DLQ); wait, use `millwright parked retry`, or pass --force to drop it", k)
		}
		return k, fmt.Sprintf(parkedChanges[action].does, k.String(), max(k.Messages-1, 0)), nil
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
	var deadLetter int64
	switch action {
	case "retry":
		err = store.RetryKey(ctx, k)
	case "release":
		err = store.ReleaseKey(ctx, k, force)
	case "skip":
		group, _ := cmd.Flags().GetString("consumer-group")
		deadLetter, err = store.Skip(ctx, k, park.SkipOptions{ConsumerGroup: group})
	}
	if err != nil {
		return change.finish(0, err)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "done: %s; a running retrier of handler %q acts within its poll interval\n", what, k.Handler)
	if deadLetter != 0 {
		fmt.Fprintf(cmd.OutOrStdout(), "the head is dead letter %d (`millwright dlq show %d`)\n", deadLetter, deadLetter)
	}
	return change.finish(1, nil)
}

// keyArg reads the KEY argument: the key's text, or with --hex its bytes
// in hex, or with --no-key a keyless message's UUID.
func keyArg(cmd *cobra.Command, arg string) (key string, keyless bool, err error) {
	asHex, _ := cmd.Flags().GetBool("hex")
	noKey, _ := cmd.Flags().GetBool("no-key")
	switch {
	case asHex && noKey:
		return "", false, fmt.Errorf("%s: --hex and --no-key exclude each other", cmd.CommandPath())
	case noKey:
		return arg, true, nil
	case asHex:
		b, err := hex.DecodeString(strings.TrimPrefix(arg, "hex:"))
		if err != nil {
			return "", false, fmt.Errorf("%s: --hex: KEY %q is not hex (as `parked list` shows a binary key, hex:0aff01): %w", cmd.CommandPath(), arg, err)
		}
		return string(b), false, nil
	}
	return arg, false, nil
}

// findParked finds key (keyless: a message without a key) among the parked
// keys of handler (of any handler when ""), which must name one.
func findParked(cmd *cobra.Command, store *park.Store, handler, key string, keyless bool) (park.Key, error) {
	found, err := store.List(cmd.Context(), park.Filter{Handler: handler, Key: key, Keyless: keyless})
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
		hint := ""
		if !keyless && strings.HasPrefix(key, "hex:") {
			hint = "; a binary key shown as hex:... is given with --hex"
		} else if !keyless && strings.HasPrefix(key, "(no key) ") {
			hint = "; a message without a key is given by its UUID with --no-key"
		}
		return park.Key{}, fmt.Errorf("%s: key %q is not parked for %s (see `millwright parked list`%s): %w", cmd.CommandPath(), key, where, hint, park.ErrNotParked)
	}
	names := make([]string, len(found))
	for i, k := range found {
		names[i] = k.Handler
	}
	return park.Key{}, fmt.Errorf("%s: key %q is parked for several handlers (%s): pass --handler", cmd.CommandPath(), key, strings.Join(names, ", "))
}
