package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/outbox/capture"
)

// outboxSwitchCmds are `outbox switch-to-debezium` and `outbox
// switch-to-relay`: capture.SwitchToDebezium and capture.SwitchToRelay on
// the command's pool, confirmed and audited like every change.
func outboxSwitchCmds() []*cobra.Command {
	toDbz := &cobra.Command{
		Use:   "switch-to-debezium",
		Short: "Prepare the outbox for Debezium's connector: capture trigger, publication, slot; report the rows the relays must still publish",
		Long: `Moves the outbox from millwright's relay to Debezium (docs/operations.md,
"Relaying with Debezium"): creates the capture trigger and an insert-only
publication (--publication), the logical replication slot (--slot) and its
boundary, then counts the pending rows inserted before the boundary: the slot
never streams them, so the relays must publish them first. With --wait it
waits for that count to reach 0. It is idempotent: run it again until it
reports "ready". Then stop the relays, start the connector on the slot
(snapshot.mode=no_data) and a capture.Tracker. While capture is on,
` + "`outbox retry-failed`" + ` is refused. --dry-run only reports.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runOutboxSwitch(cmd, args, true) },
	}
	toRelay := &cobra.Command{
		Use:   "switch-to-relay",
		Short: "Hand the outbox back to the relay after the connector has stopped",
		Long: `Moves the outbox back from Debezium to millwright's relay (docs/operations.md):
with the connector stopped (refused while it streams from --slot), marks
published the rows the slot's last confirmed capture mark saw, then drops the
slot, its boundary, the publication and the capture trigger. Then start the
relays: they publish every row still pending (what Debezium delivered after
its last confirmed mark goes out again, in order). --dry-run only reports.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error { return runOutboxSwitch(cmd, args, false) },
	}
	for _, c := range []*cobra.Command{toDbz, toRelay} {
		addDatabaseFlag(c)
		c.Flags().String("slot", "", "the replication slot (the connector's slot.name); required")
		c.Flags().String("publication", "", "the publication (the connector's publication.name); required")
		addSafetyFlags(c)
	}
	toDbz.Flags().Duration("wait", 0, "wait up to this long for the relays to publish the rows from before the slot (0: report at once)")
	return []*cobra.Command{toDbz, toRelay}
}

func runOutboxSwitch(cmd *cobra.Command, args []string, toDebezium bool) error {
	cfg := capture.SwitchConfig{}
	cfg.Slot, _ = cmd.Flags().GetString("slot")
	cfg.Publication, _ = cmd.Flags().GetString("publication")
	cfg.DryRun, _ = cmd.Flags().GetBool("dry-run")
	if toDebezium {
		cfg.Wait, _ = cmd.Flags().GetDuration("wait")
	}
	if cfg.Slot == "" || cfg.Publication == "" {
		return fmt.Errorf("%s: --slot and --publication are required (the connector's slot.name and publication.name)", cmd.CommandPath())
	}
	change, pool, err := openChange(cmd, args)
	if err != nil {
		return err
	}
	defer pool.Close()
	ctx := cmd.Context()
	dry := cfg
	dry.DryRun = true
	err = change.confirm(func() (string, error) {
		rep, err := switchOn(ctx, pool, dry, toDebezium)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("%d step(s) to do: %v", len(rep.Steps), rep.Steps), nil
	})
	if err != nil {
		return change.finish(0, err)
	}
	rep, err := switchOn(ctx, pool, cfg, toDebezium)
	printSwitch(cmd.OutOrStdout(), rep, toDebezium)
	return change.finish(rep.Marked, err)
}

func switchOn(ctx context.Context, pool *cliPool, cfg capture.SwitchConfig, toDebezium bool) (capture.SwitchReport, error) {
	if toDebezium {
		return capture.SwitchToDebezium(ctx, pool.handle(), cfg)
	}
	return capture.SwitchToRelay(ctx, pool.handle(), cfg)
}

func printSwitch(out io.Writer, rep capture.SwitchReport, toDebezium bool) {
	verb := "done"
	if rep.DryRun {
		verb = "to do"
	}
	for _, s := range rep.Steps {
		fmt.Fprintf(out, "%s: %s\n", verb, s)
	}
	if len(rep.Steps) == 0 {
		fmt.Fprintln(out, "nothing to change")
	}
	if toDebezium {
		fmt.Fprintf(out, "pending rows from before the slot (the relays' to publish): %d\n", rep.PendingBefore)
		if rep.Ready {
			fmt.Fprintln(out, "ready")
		}
	} else {
		fmt.Fprintf(out, "marked published (confirmed by the slot): %d; pending for the relays: %d\n", rep.Marked, rep.Pending)
	}
	if rep.Next != "" {
		fmt.Fprintf(out, "next: %s\n", rep.Next)
	}
}
