// Command millwright is the operator CLI: database migrations, benchmarks and
// the inspection and repair commands of each component.
package main

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright/internal/bench/debeziumbench"
	"github.com/millwright/millwright/internal/interrupt"
	_ "github.com/millwright/millwright/transport/all" // the CLI reaches every kind
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
// --cpuprofile writes a Go CPU profile of the whole run (go tool pprof).
var benchCmd = &cobra.Command{
	Use:   "bench",
	Short: "Run a benchmark and print its figures beside the baseline",
	PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
		path, _ := cmd.Flags().GetString("cpuprofile")
		if path == "" {
			return nil
		}
		f, err := os.Create(path)
		if err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			_ = f.Close()
			return fmt.Errorf("--cpuprofile %s: %w", path, err)
		}
		cpuProfile = f
		return nil
	},
	PersistentPostRunE: func(*cobra.Command, []string) error { return stopCPUProfile() },
}

// cpuProfile is the file a bench's --cpuprofile writes, while it runs.
var cpuProfile *os.File

// stopCPUProfile ends and closes the --cpuprofile profile, if one runs (a
// failed bench skips PersistentPostRunE: main calls it too).
func stopCPUProfile() error {
	if cpuProfile == nil {
		return nil
	}
	pprof.StopCPUProfile()
	err := cpuProfile.Close()
	cpuProfile = nil
	return err
}

func init() {
	rootCmd.AddCommand(benchCmd)
	benchCmd.AddCommand(debeziumbench.Command())
	addSchemaFlag(rootCmd)
	addDriverFlag(rootCmd)
	benchCmd.PersistentFlags().String("cpuprofile", "", "write a Go CPU profile of the benchmark to this file (read it with go tool pprof)")
}

// main runs the command with a context that SIGINT and SIGTERM cancel:
// every wait watches it, and interrupt's backstop makes the process exit
// within a second of the signal even if one does not.
func main() {
	ctx, stop := interrupt.Context(context.Background(), "millwright")
	err := rootCmd.ExecuteContext(ctx)
	stop()
	if perr := stopCPUProfile(); err == nil {
		err = perr
	}
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
