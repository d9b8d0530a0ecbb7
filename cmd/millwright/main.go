// Command millwright is the operator CLI: database migrations, benchmarks and
// the inspection and repair commands of each component.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

// rootCmd is the top of the command tree. Each component adds its commands
// from its own file in an init function, so files do not collide.
var rootCmd = &cobra.Command{
	Use:           "millwright",
	Short:         "Operate millwright: migrations, benchmarks, outbox, DLQ and saga tools",
	SilenceUsage:  true,
	SilenceErrors: true,
}

// benchCmd groups the benchmarks; each component adds `bench <component>`.
var benchCmd = &cobra.Command{
	Use:   "bench",
	Short: "Run a benchmark and print its figures beside the baseline",
}

func init() {
	rootCmd.AddCommand(benchCmd)
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := rootCmd.ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "millwright:", err)
		os.Exit(1)
	}
}
