package audit

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
	"time"

	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns the SQL migrations creating millwright_audit in the
// first schema of the search_path.
func Migrations() migrate.Source {
	return migrate.Embedded("audit", migrationFiles, "migrations")
}

// Entry is one audited command run.
type Entry struct {
	// ID is the row id, set by List.
	ID int64
	// At is when the row was written, set by the database.
	At time.Time
	// User is the operating-system user who ran the command ($USER, else
	// the account's name).
	User string
	// Host is the machine's hostname.
	Host string
	// Command is the full command path, e.g. "millwright dlq replay".
	Command string
	// Args are the positional arguments and the flags set, as
	// "--name=value", with secrets redacted (see RedactArgs).
	Args []string
	// DryRun is true when the command only showed what it would do.
	DryRun bool
	// Confirmed says how the change was allowed: "--yes", "prompt" or
	// "dry-run".
	Confirmed string
	// Affected is the number of rows changed (or that would be, for a dry
	// run).
	Affected int64
	// Error is the command's error when it failed, possibly after changing
	// Affected rows; empty on success.
	Error string
	// Change is what the action changed in a message, for the actions
	// that change one (dlq.ReplayTx with an Edit: the console's edit and
	// replay): a line diff, each line starting with "  " (kept), "- "
	// (removed) or "+ " (added), secrets masked. Empty for the others.
	// Stored as given (audit migration 002).
	Change string
}

// ErrNotMigrated is returned by Ready and Record when millwright_audit does
// not exist in the search_path: run `millwright migrate`.
var ErrNotMigrated = errors.New("audit: table millwright_audit does not exist: run `millwright migrate` first")

// Ready returns ErrNotMigrated when the audit table is missing from db's
// search_path (or the caller's transaction's), so a command can refuse
// before it changes anything it could not audit.
func Ready(ctx context.Context, db postgres.Handle) error {
	q, err := storage.FromHandle(db)
	if err != nil {
		return fmt.Errorf("audit: Ready: %w", err)
	}
	ok, err := storage.AuditTableExists(ctx, q)
	if err != nil {
		return fmt.Errorf("audit: checking for table millwright_audit: %w", err)
	}
	if !ok {
		return ErrNotMigrated
	}
	return nil
}

// Record writes e on its own (autocommit) and returns the row id. User,
// Host and Args are stored as given: pass Args through RedactArgs. A
// record of a change that shares the change's transaction is RecordTx.
func Record(ctx context.Context, db postgres.DB, e Entry) (int64, error) {
	q, err := storage.FromDB(db)
	if err != nil {
		return 0, fmt.Errorf("audit: Record: %w", err)
	}
	return record(ctx, q, e)
}

// RecordTx writes e in tx, the transaction of the change it records, so
// that the change and its audit row commit or roll back together. It is
// the one writer of millwright_audit rows in the transaction of a change:
// the operator actions (dlq.ReplayTx, outbox.RetryFailedTx, ...) and the
// console call it. It returns ErrNotMigrated when the table is missing
// (tx is then aborted on Postgres: roll it back).
func RecordTx(ctx context.Context, tx postgres.Tx, e Entry) (int64, error) {
	q, err := storage.FromTx(tx)
	if err != nil {
		return 0, fmt.Errorf("audit: RecordTx: %w", err)
	}
	return record(ctx, q, e)
}

func record(ctx context.Context, q storage.Querier, e Entry) (int64, error) {
	if e.Command == "" {
		return 0, errors.New("audit: Entry.Command is empty: name the command run")
	}
	id, err := storage.InsertAudit(ctx, q, storage.AuditRow{
		User: e.User, Host: e.Host, Command: e.Command, Args: e.Args, DryRun: e.DryRun,
		Confirmed: e.Confirmed, Affected: e.Affected, Error: e.Error, Change: e.Change,
	})
	if storage.Code(err) == "42P01" { // undefined_table
		return 0, ErrNotMigrated
	}
	if err != nil {
		return 0, fmt.Errorf("audit: writing to millwright_audit: %w", err)
	}
	return id, nil
}

// List returns the newest limit rows, newest first (limit <= 0: all), on
// db or in the caller's transaction.
func List(ctx context.Context, db postgres.Handle, limit int) ([]Entry, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("audit: List: %w", err)
	}
	rows, err := storage.ListAudit(ctx, q, limit)
	if err != nil {
		return nil, fmt.Errorf("audit: reading millwright_audit (run `millwright migrate` first?): %w", err)
	}
	var out []Entry // nil for none, as before
	if len(rows) > 0 {
		out = make([]Entry, len(rows))
	}
	for i, r := range rows {
		out[i] = Entry{ID: r.ID, At: r.At, User: r.User, Host: r.Host, Command: r.Command, Args: r.Args,
			DryRun: r.DryRun, Confirmed: r.Confirmed, Affected: r.Affected, Error: r.Error, Change: r.Change}
	}
	return out, nil
}

// CurrentUser names who runs this process: $USER when set, else the
// account name, else "unknown".
func CurrentUser() string {
	if u := os.Getenv("USER"); u != "" {
		return u
	}
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return "unknown"
}

// Hostname returns the machine's name, or "unknown".
func Hostname() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return h
	}
	return "unknown"
}

// Redacted replaces a secret.
const Redacted = redact.Mask

// RedactArgs returns args with secrets replaced by Redacted: the password
// of every URL, query parameters and key=value pairs named like a secret,
// and the value of every "--flag=value" whose flag name is. An argument
// Postgres text cannot hold (invalid UTF-8, a NUL byte: a binary key
// passed on the command line) is stored Go-quoted ("\xff", "\x00"), so
// the audit row of a change that committed is never refused. It never
// returns the input slice.
func RedactArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = redactArg(a)
	}
	return out
}

func redactArg(a string) string {
	if strings.HasPrefix(a, "--") {
		if name, val, ok := strings.Cut(a[2:], "="); ok {
			if redact.SecretName(name) {
				return "--" + quoteUnstorable(name) + "=" + Redacted
			}
			return "--" + quoteUnstorable(name) + "=" + quoteUnstorable(RedactValue(val))
		}
	}
	return quoteUnstorable(RedactValue(a))
}

// quoteUnstorable returns s Go-quoted when Postgres text cannot hold it.
func quoteUnstorable(s string) string {
	if storage.CheckText(s) != nil {
		return strconv.Quote(s)
	}
	return s
}

// RedactValue hides the secrets of one value or free text (see
// internal/redact.Text).
func RedactValue(v string) string { return redact.Text(v) }

// Operator is who runs an operator action and how it was allowed: the
// fields of the action's audit row that the action cannot know itself.
// The actions that write their own audit row in their transaction
// (dlq.Replay and dlq.ReplayTx, one row per dead letter) take one, so the
// row's command and arguments are the action's, the same whichever
// caller (the CLI, the console, a service) ran it.
type Operator struct {
	// User names the operator: the console's authenticated operator, the
	// CLI's CurrentUser. Required.
	User string
	// Host is where the action ran: "console", or the CLI's Hostname.
	// Default: Hostname().
	Host string
	// Confirmed says how the action was allowed ("--yes", "prompt",
	// "console"). Default "api".
	Confirmed string
}

// Entry is the audit row of an action run by o: command, its arguments
// (redacted here, see RedactArgs) and the rows it affected.
func (o Operator) Entry(command string, args []string, affected int64) Entry {
	e := Entry{User: o.User, Host: o.Host, Command: command, Args: RedactArgs(args), Confirmed: o.Confirmed, Affected: affected}
	if e.Host == "" {
		e.Host = Hostname()
	}
	if e.Confirmed == "" {
		e.Confirmed = "api"
	}
	return e
}

// Valid reports an Operator without a User.
func (o Operator) Valid() error {
	if strings.TrimSpace(o.User) == "" {
		return errors.New("audit: Operator.User is empty: name who runs the action (it goes into millwright_audit)")
	}
	return nil
}
