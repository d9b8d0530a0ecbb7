// Command millwright is the operator CLI: database migrations and the
// inspection and repair commands of each component. The benchmarks are a
// command of their own, millwright-bench.
package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/interrupt"
	_ "github.com/millwright/millwright/transport/all" // the CLI reaches every kind
)

// rootCmd is the top of the command tree. Each component adds its commands
// from its own file in an init function, so files do not collide.
var rootCmd = &cobra.Command{
	Use:   "millwright",
	Short: "Operate millwright: migrations, outbox, DLQ, saga, park and idempotency tools",
	Long: `Operate millwright: migrations, and the inspection and repair commands of
the outbox, the dead-letter queue, sagas, parked keys and idempotency marks.

The benchmarks are a command of their own: millwright-bench.`,
	SilenceUsage:  true,
	SilenceErrors: true,
}

func init() {
	addSchemaFlag(rootCmd)
	addDriverFlag(rootCmd)
}

// main runs the command with a context that SIGINT and SIGTERM cancel:
// every wait watches it, and interrupt's backstop makes the process exit
// within a second of the signal even if one does not.
func main() {
	ctx, stop := interrupt.Context(context.Background(), "millwright")
	err := rootCmd.ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, errorLine(err))
		os.Exit(1)
	}
}

// errorLine is the line main prints for err: prefixed with "millwright: "
// unless the error already starts with the command's path ("millwright
// outbox retry-failed: ..."), which said "millwright: millwright ...".
func errorLine(err error) string {
	msg := err.Error()
	if strings.HasPrefix(msg, rootCmd.Name()+" ") || strings.HasPrefix(msg, rootCmd.Name()+":") {
		return msg
	}
	return rootCmd.Name() + ": " + msg
}
