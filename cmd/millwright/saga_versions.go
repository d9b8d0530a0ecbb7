package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/saga"
)

func sagaVersionsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "versions",
		Short: "Count saga instances per type, definition version and state; say which versions are retired",
		Long: `An instance runs on the definition version it started on (saga.DefineVersion)
to its end. An orchestrator runs older versions beside its own while they
are listed in saga.Config.Versions; a version is retired, and may be removed
from Config.Versions, once no instance of it is left (LIVE 0: none running,
compensating or stuck).

Migrating running instances to a newer version is declared in Go
(saga.Migrate in Config.Migrations) and run by the service that holds the
definitions: Orchestrator.PlanMigration is the dry run, Orchestrator.Migrate
applies it with an audit row per instance. This command has no definitions,
so it only shows where the instances are.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			vs, err := saga.Versions(cmd.Context(), pool.handle())
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON, _ := cmd.Flags().GetBool("json"); asJSON {
				enc := json.NewEncoder(out)
				for _, v := range vs {
					counts := map[string]int64{}
					for s, n := range v.Counts {
						counts[string(s)] = n
					}
					row := map[string]any{"type": v.Type, "version": v.Version, "counts": counts, "live": v.Live,
						"retired": v.Retired(), "fingerprints": v.Fingerprints}
					if !v.LastSeen.IsZero() {
						row["last_seen"] = v.LastSeen
					}
					if err := enc.Encode(row); err != nil {
						return err
					}
				}
				return nil
			}
			if len(vs) == 0 {
				fmt.Fprintln(out, "no saga instances and no registered definitions")
				return nil
			}
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			states := []saga.State{saga.StateRunning, saga.StateCompensating, saga.StateStuck, saga.StateCompleted, saga.StateCompensated}
			head := []string{"TYPE", "VERSION", "LIVE"}
			for _, s := range states {
				head = append(head, strings.ToUpper(string(s)))
			}
			fmt.Fprintln(w, strings.Join(append(head, "STATUS", "LAST SEEN"), "\t"))
			for _, v := range vs {
				cols := []string{v.Type, fmt.Sprint(v.Version), fmt.Sprint(v.Live)}
				for _, s := range states {
					cols = append(cols, fmt.Sprint(v.Counts[s]))
				}
				status := "in use"
				if v.Retired() {
					status = "retired"
				}
				seen := "-"
				if !v.LastSeen.IsZero() {
					seen = v.LastSeen.UTC().Format(time.RFC3339)
				}
				fmt.Fprintln(w, strings.Join(append(cols, status, seen), "\t"))
			}
			return w.Flush()
		},
	}
	cmd.Flags().Bool("json", false, "print one JSON object per type and version instead of the table")
	addDatabaseFlag(cmd)
	return cmd
}
