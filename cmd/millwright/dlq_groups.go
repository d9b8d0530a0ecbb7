package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/dlq"
)

// causeRow is one cause of `dlq groups --json`.
type causeRow struct {
	Fingerprint string    `json:"fingerprint"`
	Handler     string    `json:"handler"`
	ErrorType   string    `json:"error_type"`
	Pattern     string    `json:"pattern"`
	Count       int64     `json:"count"`
	Dead        int64     `json:"dead"`
	FirstSeen   time.Time `json:"first_seen"`
	LastSeen    time.Time `json:"last_seen"`
	Topics      []string  `json:"topics"`
	SampleID    int64     `json:"sample_id"`
	SampleUUID  string    `json:"sample_message_uuid"`
	SampleError string    `json:"sample_error"`
}

func dlqGroupsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "groups",
		Short: "Group dead letters by the cause of their failure (fingerprint), largest first",
		Long: `A cause is a fingerprint of the failure: the handler, the error's Go type and
its message with numbers, UUIDs, hex ids, durations and quoted values
replaced (dlq.NormalizeError), so that "order 17 refused" and "order 9
refused" are one cause and two errors.New of one Go type are two. The same
groups as the console's first page: dead letters still dead, unless --all.
List one group's dead letters with ` + "`millwright dlq list`" + ` (its sample's error
text with --error), or on the console (dead-letters?cause=FINGERPRINT).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f, err := dlqFilterFromFlags(cmd)
			if err != nil {
				return err
			}
			all, _ := cmd.Flags().GetBool("all")
			asJSON, _ := cmd.Flags().GetBool("json")
			f.Pending = !all
			pool, err := openPool(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			causes, err := dlqStore(pool).Causes(cmd.Context(), f)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				for _, c := range causes {
					r := causeRow{Fingerprint: c.Fingerprint, Handler: c.Handler, ErrorType: c.ErrorType, Pattern: dlq.Redacted(c.Pattern),
						Count: c.Count, Dead: c.Dead, FirstSeen: c.FirstSeen.UTC(), LastSeen: c.LastSeen.UTC(), Topics: c.Topics,
						SampleID: c.SampleID, SampleUUID: dlq.Printable(c.SampleUUID), SampleError: dlq.Redacted(c.SampleError)}
					if r.Topics == nil {
						r.Topics = []string{}
					}
					if err := enc.Encode(r); err != nil {
						return err
					}
				}
				return nil
			}
			if len(causes) == 0 {
				fmt.Fprintln(out, "no dead letters match")
				return nil
			}
			w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "FINGERPRINT\tCOUNT\tDEAD\tFIRST SEEN\tLAST SEEN\tHANDLER\tERROR TYPE\tTOPICS\tSAMPLE\tCAUSE")
			for _, c := range causes {
				fmt.Fprintf(w, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", c.Fingerprint, c.Count, c.Dead,
					c.FirstSeen.UTC().Format(time.RFC3339), c.LastSeen.UTC().Format(time.RFC3339), dlqOneLine(c.Handler, 30),
					dlqOneLine(c.ErrorType, 30), dlqOneLine(strings.Join(c.Topics, ","), 40), c.SampleID, dlqOneLine(dlq.Redacted(c.Pattern), 80))
			}
			return w.Flush()
		},
	}
	f := cmd.Flags()
	f.String("topic", "", "only dead letters from this original topic")
	f.String("since", "", "only dead letters whose last failure is at or after this time (RFC 3339, or a duration such as 24h meaning that long ago)")
	f.String("until", "", "only dead letters whose last failure is before this time (RFC 3339 or a duration ago)")
	f.String("error", "", "only dead letters whose error contains this text (case-insensitive)")
	f.Int("limit", 0, "unused by groups (every group is counted)")
	f.Int64Slice("id", nil, "unused by groups")
	_ = f.MarkHidden("limit")
	_ = f.MarkHidden("id")
	f.Bool("all", false, "also count dead letters replayed, superseded by an edit or resolved (default: those still dead, as the console)")
	f.Bool("json", false, "print one JSON object per cause instead of the table")
	addDatabaseFlag(cmd)
	return cmd
}
