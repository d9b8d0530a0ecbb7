package console

import (
	"context"

	"github.com/millwright/millwright/transport/lag"
)

// lagGroup is one consumer group's rows, with its total.
type lagGroup struct {
	Transport, Group string
	Total            int64
	Rows             []lag.Partition
}

type lagData struct {
	// Configured: Config.Lag is set.
	Configured bool
	Groups     []lagGroup
	// Error is the reading's error, shown beside the rows that were read.
	Error string
}

// lagPage shows Config.Lag's consumer lag, read from the brokers when the
// page loads.
func (h *Handler) lagPage(ctx context.Context, q *req) error {
	d := lagData{Configured: h.cfg.Lag != nil}
	if d.Configured {
		ps, err := h.cfg.Lag.Lag(ctx)
		if err != nil {
			d.Error = err.Error()
			h.cfg.Logger.Error("console: reading consumer lag", err, nil)
		}
		for _, p := range ps {
			if n := len(d.Groups); n == 0 || d.Groups[n-1].Transport != p.Transport || d.Groups[n-1].Group != p.Group {
				d.Groups = append(d.Groups, lagGroup{Transport: p.Transport, Group: p.Group})
			}
			g := &d.Groups[len(d.Groups)-1]
			g.Total += p.Lag
			g.Rows = append(g.Rows, p)
		}
	}
	return h.render(q, "lag.html", &view{Title: "Consumer lag", Nav: "lag", Data: d})
}
