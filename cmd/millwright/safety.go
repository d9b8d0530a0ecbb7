package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/postgres"
)

// Operator safety for commands that change state (dlq replay, outbox
// retry-failed, saga resolve, clean and every <component> clean):
//
//   - every flag is validated first: a run refused for a flag changes
//     nothing and writes nothing, not even an audit row;
//   - --dry-run shows what would change; the only thing it writes is its
//     millwright_audit row (none where the table does not exist);
//   - without --yes, a terminal on stdin is asked to confirm after being
//     shown what will change; anything else (CI, a pipe, cron) is refused,
//     so a script can never change state without saying so;
//   - every run past validation, dry or not, failed or not, writes one
//     millwright_audit row (who, where, when, command, redacted arguments,
//     rows affected).

func init() {
	registerMigrations(audit.Migrations())
	rootCmd.AddCommand(auditCmd())
}

func auditCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "Show the audit trail of state-changing commands (millwright_audit)",
	}
	list := &cobra.Command{
		Use:   "list",
		Short: "List audited runs, newest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			limit, _ := cmd.Flags().GetInt("limit")
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			rows, err := audit.List(cmd.Context(), pool.handle(), limit)
			if err != nil {
				return err
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tAT\tWHO\tCOMMAND\tDRY RUN\tCONFIRMED\tAFFECTED\tARGS\tERROR")
			for _, e := range rows {
				fmt.Fprintf(w, "%d\t%s\t%s@%s\t%s\t%t\t%s\t%d\t%s\t%s\n", e.ID, e.At.UTC().Format(time.RFC3339), e.User, e.Host,
					e.Command, e.DryRun, e.Confirmed, e.Affected, strings.Join(e.Args, " "), oneLine(e.Error, 80))
			}
			return w.Flush()
		},
	}
	list.Flags().Int("limit", 50, "at most this many rows (0: all)")
	addDatabaseFlag(list)
	cmd.AddCommand(list, cleanCmd("audit"))
	return cmd
}

// ErrNotConfirmed is returned when the operator answers no to the prompt.
var ErrNotConfirmed = errors.New("not confirmed: nothing changed")

// errNeedsYes is returned when stdin is not a terminal and --yes is absent.
var errNeedsYes = errors.New("stdin is not a terminal, so there is no one to confirm: pass --yes to proceed (or --dry-run to see what would change)")

// addSafetyFlags adds --yes, and --dry-run unless the command has it.
func addSafetyFlags(cmd *cobra.Command) {
	if cmd.Flags().Lookup("dry-run") == nil {
		cmd.Flags().Bool("dry-run", false, "show what would change; writes only its millwright_audit row (none where that table does not exist)")
	}
	cmd.Flags().Bool("yes", false, "proceed without asking for confirmation (required when stdin is not a terminal)")
}

// terminal is implemented by an input that reports whether it is a
// terminal; tests use it to stand in for one.
type terminal = cli.Terminal

func isTerminal(r io.Reader) bool {
	if t, ok := r.(terminal); ok {
		return t.IsTerminal()
	}
	f, ok := r.(*os.File)
	return ok && cli.FileIsTerminal(f)
}

// change is one run of a state-changing command.
type change struct {
	cmd       *cobra.Command
	args      []string
	dryRun    bool
	yes       bool
	confirmed string
	// audit is where finish writes the audit row: the command's pool;
	// the zero DB for a dry run without the table.
	audit postgres.DB
}

// newChange reads --dry-run and --yes and refuses at once, before any
// connection is made, a run that could not be confirmed.
func newChange(cmd *cobra.Command, args []string) (*change, error) {
	c := &change{cmd: cmd, args: args}
	c.dryRun, _ = cmd.Flags().GetBool("dry-run")
	c.yes, _ = cmd.Flags().GetBool("yes")
	if !c.dryRun && !c.yes && !isTerminal(cmd.InOrStdin()) {
		return nil, fmt.Errorf("%s: %w", cmd.CommandPath(), errNeedsYes)
	}
	return c, nil
}

// openChange starts a state-changing command: it checks the flags
// (newChange, before connecting), opens the pool of --driver (openPool),
// runs validate (the checks of flag values that need the database, such as
// building a cleaner from its retention) and checks that the change can be
// audited (ready). A run refused by validate, like one refused by a flag
// checked before openChange, wrote nothing: no audit row either, dry run
// or not. The command's changes and its audit row go through the one
// returned pool, which the caller closes.
func openChange(cmd *cobra.Command, args []string, validate ...func(*cliPool) error) (*change, *cliPool, error) {
	c, err := newChange(cmd, args)
	if err != nil {
		return nil, nil, err
	}
	pool, err := openPool(cmd)
	if err != nil {
		return nil, nil, err
	}
	for _, v := range validate {
		if err := v(pool); err != nil {
			pool.Close()
			return nil, nil, err
		}
	}
	if err := c.ready(pool.handle()); err != nil {
		pool.Close()
		return nil, nil, err
	}
	return c, pool, nil
}

// ready checks that the audit table exists in db, so nothing is changed
// that could not be audited; finish writes there.
// A dry run changes nothing but its audit row, so it runs without the
// table: it is audited only where the table exists.
func (c *change) ready(db postgres.DB) error {
	if err := audit.Ready(c.cmd.Context(), db); err != nil {
		if c.dryRun {
			fmt.Fprintf(c.cmd.ErrOrStderr(), "dry run not audited: %v\n", err)
			return nil // c.audit stays nil: finish records nothing
		}
		return fmt.Errorf("%s: refusing to change anything that cannot be audited: %w", c.cmd.CommandPath(), err)
	}
	c.audit = db
	return nil
}

// confirm asks the terminal to confirm, showing describe's text. It
// returns nil at once for a dry run or with --yes.
func (c *change) confirm(describe func() (string, error)) error {
	switch {
	case c.dryRun:
		c.confirmed = "dry-run"
		return nil
	case c.yes:
		c.confirmed = "--yes"
		return nil
	}
	what, err := describe()
	if err != nil {
		return err
	}
	errOut := c.cmd.ErrOrStderr()
	fmt.Fprintf(errOut, "%s\nProceed? [y/N] ", strings.TrimRight(what, "\n"))
	line, err := bufio.NewReader(c.cmd.InOrStdin()).ReadString('\n')
	if err != nil && line == "" {
		fmt.Fprintln(errOut)
		return fmt.Errorf("%s: reading the answer: %w", c.cmd.CommandPath(), ErrNotConfirmed)
	}
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		c.confirmed = "prompt"
		return nil
	}
	return fmt.Errorf("%s: %w", c.cmd.CommandPath(), ErrNotConfirmed)
}

// finish writes the audit row for the run and returns runErr, joined with
// the audit error if the row could not be written.
func (c *change) finish(affected int64, runErr error) error {
	if c.audit.Valid() != nil {
		return runErr
	}
	if c.confirmed == "" {
		// confirm was not reached: a dry run, or a failure before it.
		c.confirmed = "none"
		if c.dryRun {
			c.confirmed = "dry-run"
		}
	}
	e := audit.Entry{
		User: audit.CurrentUser(), Host: audit.Hostname(),
		Command:   c.cmd.CommandPath(),
		Args:      audit.RedactArgs(commandArgs(c.cmd, c.args)),
		DryRun:    c.dryRun,
		Confirmed: c.confirmed,
		Affected:  affected,
	}
	if runErr != nil {
		e.Error = audit.RedactValue(runErr.Error())
	}
	id, err := audit.Record(context.WithoutCancel(c.cmd.Context()), c.audit, e)
	if err != nil {
		return errors.Join(runErr, fmt.Errorf("%s changed %d row(s) but the audit row was not written: %w", c.cmd.CommandPath(), affected, err))
	}
	fmt.Fprintf(c.cmd.ErrOrStderr(), "audited as millwright_audit row %d\n", id)
	return runErr
}

// commandArgs lists the positional arguments, then every flag set, as
// --name=value.
func commandArgs(cmd *cobra.Command, args []string) []string {
	out := append([]string{}, args...)
	cmd.Flags().Visit(func(f *pflag.Flag) {
		out = append(out, "--"+f.Name+"="+f.Value.String())
	})
	return out
}

// firstLines keeps the first n lines of a preview and its last line (the
// summary), saying how many were left out.
func firstLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) <= n+1 {
		return strings.Join(lines, "\n")
	}
	kept := append(lines[:n:n], fmt.Sprintf("... %d more line(s) ...", len(lines)-n-1), lines[len(lines)-1])
	return strings.Join(kept, "\n")
}
