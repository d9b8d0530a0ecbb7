package consumebench

import (
	"context"
	"time"
)

// throughput runs both consumers over one topic with handlers of delay d.
func (b *bench) throughput(ctx context.Context, d time.Duration) ([]Row, error) {
	n := b.cfg.messages(d)
	tp, err := b.publish(ctx, n)
	if err != nil {
		return nil, err
	}
	// Watermill's subscriber runs a partition one message at a time.
	serial := time.Duration(n) * (d + 2*time.Millisecond) / time.Duration(b.cfg.Partitions)
	timeout := 2*serial + 2*time.Minute
	var rows []Row
	for _, c := range []string{ConsumerWatermill, ConsumerKeyed} {
		row, err := b.consume(ctx, tp, run{consumer: c, delay: d, timeout: timeout})
		if err != nil {
			return rows, err
		}
		row.Scenario = "throughput"
		rows = append(rows, row)
	}
	base, keyed := &rows[0], &rows[1]
	if base.Rate > 0 {
		keyed.Ratio = keyed.Rate / base.Rate
	}
	switch d {
	case 0:
		keyed.Target = TargetTrivial
	case 50 * time.Millisecond:
		keyed.Target = TargetSlowHandler
	}
	return rows, nil
}

// failingKeyDelay is the handler's transaction in the failing-key scenario.
const failingKeyDelay = 5 * time.Millisecond

// failingKey runs the keyed consumer with KeyFailureMiddleware three
// times over one topic: without a failure, with the key that has the most
// messages failing for FailFor from the run's start, and without a failure
// again. Rate is the other keys' messages/s; the failing run's ratio is
// over the mean of the two others.
func (b *bench) failingKey(ctx context.Context) ([]Row, error) {
	n := max(100, int(16000*b.cfg.Scale))
	tp, err := b.publish(ctx, n)
	if err != nil {
		return nil, err
	}
	count := map[string]int{}
	failing := ""
	for _, r := range tp.where {
		count[r.key]++
		if count[r.key] > count[failing] || (count[r.key] == count[failing] && r.key < failing) {
			failing = r.key
		}
	}
	timeout := b.cfg.FailFor + 5*time.Minute
	var rows []Row
	// Without failure before and after the failing run, so that what
	// drifts on the machine falls on both sides of the comparison.
	for _, fail := range []bool{false, true, false} {
		r := run{consumer: ConsumerKeyed, delay: failingKeyDelay, wrap: true, timeout: timeout}
		if fail {
			r.failingKey, r.failUntil = failing, time.Now().Add(b.cfg.FailFor)
		}
		row, err := b.consume(ctx, tp, r)
		if err != nil {
			return rows, err
		}
		row.Scenario = "one key failing"
		rows = append(rows, row)
	}
	if base := (rows[0].Rate + rows[2].Rate) / 2; base > 0 {
		rows[1].Ratio = rows[1].Rate / base
	}
	rows[1].Target = TargetFailingOther
	return rows, nil
}
