package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/storage"
)

func init() {
	registerMigrations(idempotency.Migrations())
	rootCmd.AddCommand(idempotencyCmd())
}

func idempotencyCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "idempotency",
		Short: "Inspect and clean the processed-events table of idempotent consumers",
	}
	clean := cleanCmd("idempotency")

	stats := &cobra.Command{
		Use:   "stats",
		Short: "Print the number of processed marks per consumer and the oldest mark",
		RunE: func(cmd *cobra.Command, _ []string) error {
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			marks, err := storage.CountMarksByConsumer(cmd.Context(), pool.storage())
			if err != nil {
				return fmt.Errorf("reading millwright_processed_events (run `millwright migrate` first?): %w", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%-40s %12s  %s\n", "CONSUMER", "MARKS", "OLDEST")
			for _, m := range marks {
				fmt.Fprintf(cmd.OutOrStdout(), "%-40s %12d  %s\n", m.Consumer, m.Marks, m.Oldest.UTC().Format(time.RFC3339))
			}
			return nil
		},
	}
	addDatabaseFlag(stats)
	cmd.AddCommand(clean, stats)
	return cmd
}
