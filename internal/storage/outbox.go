package storage

import (
	"context"
	"strconv"
	"strings"
)

// EventRow is one row of millwright_outbox as Add writes it.
type EventRow struct {
	EventID       string
	Topic         string
	AggregateType string
	AggregateID   string
	EventType     string
	// Payload goes to the JSONB payload column when IsJSON, else byte for
	// byte to payload_raw.
	Payload []byte
	IsJSON  bool
	// Metadata is a JSON object of strings ("{}" for none).
	Metadata string
}

const insertEventsPrefix = `INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, payload_raw, metadata) VALUES `

// InsertEvents writes rows to millwright_outbox in one multi-row INSERT
// (callers keep a statement to a bounded number of rows: outbox.Add sends
// 1,000 at most).
func InsertEvents(ctx context.Context, q Querier, rows []EventRow) error {
	if len(rows) == 0 {
		return nil
	}
	_, err := q.Exec(ctx, InsertEventsStatement(rows))
	return err
}

// InsertEventsStatement is InsertEvents' statement, for a Queue or Batch.
func InsertEventsStatement(rows []EventRow) Statement {
	var b strings.Builder
	b.Grow(len(insertEventsPrefix) + len(rows)*48)
	b.WriteString(insertEventsPrefix)
	args := make([]any, 0, 8*len(rows))
	for i, r := range rows {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('(')
		for j := range 8 {
			if j > 0 {
				b.WriteByte(',')
			}
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(8*i + j + 1))
			switch j {
			case 5:
				b.WriteString("::jsonb")
			case 7:
				b.WriteString("::jsonb")
			}
		}
		b.WriteByte(')')
		var payload, raw any
		if r.IsJSON {
			payload = string(r.Payload)
		} else {
			raw = r.Payload
		}
		md := r.Metadata
		if md == "" {
			md = "{}"
		}
		args = append(args, r.EventID, r.Topic, r.AggregateType, r.AggregateID, r.EventType, payload, raw, md)
	}
	return Statement{SQL: b.String(), Args: args, Expect: NoExpect, What: "inserting " + strconv.Itoa(len(rows)) + " outbox event(s)"}
}
