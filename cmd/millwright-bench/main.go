// Command millwright-bench runs millwright's benchmarks: each component's
// figures (outbox, idempotency, saga, consume, transport, memory, Debezium)
// beside its baseline. The operator commands are the millwright command's;
// this one links the in-process fakes (kfake, pstest) that a benchmark runs
// on when no real broker is named.
package main

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright-bench/internal/bench/debeziumbench"
	"github.com/millwright/millwright/internal/interrupt"
	_ "github.com/millwright/millwright/transport/all"      // a benchmark reaches every kind
	_ "github.com/millwright/millwright/transport/embedded" // and the fakes it runs on without a broker
)

// rootCmd is the top of the command tree: each benchmark adds itself from
// its own file in an init function. --cpuprofile writes a Go CPU profile of
// the whole run (go tool pprof).
var rootCmd = &cobra.Command{
	Use:           "millwright-bench",
	Short:         "Run a millwright benchmark and print its figures beside the baseline",
	SilenceUsage:  true,
	SilenceErrors: true,
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
	rootCmd.AddCommand(debeziumbench.Command(), benchIdempotencyCmd(), benchOutboxCmd(), benchSagaCmd())
	addDriverFlag(rootCmd)
	rootCmd.PersistentFlags().String("cpuprofile", "", "write a Go CPU profile of the benchmark to this file (read it with go tool pprof)")
}

// main runs the command with a context that SIGINT and SIGTERM cancel:
// every wait watches it, and interrupt's backstop makes the process exit
// within a second of the signal even if one does not.
func main() {
	ctx, stop := interrupt.Context(context.Background(), "millwright-bench")
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

// errorLine is the line main prints for err: prefixed with
// "millwright-bench: " unless the error already starts with the command's
// name.
func errorLine(err error) string {
	msg := err.Error()
	if strings.HasPrefix(msg, rootCmd.Name()+" ") || strings.HasPrefix(msg, rootCmd.Name()+":") {
		return msg
	}
	return rootCmd.Name() + ": " + msg
}
