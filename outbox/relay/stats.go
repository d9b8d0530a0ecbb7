package relay

import (
	"sync/atomic"
	"time"
)

// Stats is a snapshot of a relay's counters since New. Reading
// it takes no lock and no database round trip, so a readiness probe or a
// status page may call Relay.Stats as often as it likes.
type Stats struct {
	// Published counts events published and marked published.
	Published uint64
	// Retried counts failed publish attempts followed by a backoff.
	Retried uint64
	// Failed counts events moved to the failed state (parked for
	// `millwright outbox retry-failed`) after their last attempt.
	Failed uint64
	// DeadLettered counts copies of failed events accepted by
	// Config.DeadLetterTopic.
	DeadLettered uint64
	// Rounds counts claim → publish → mark rounds, empty ones included.
	Rounds uint64
	// Cut counts batches whose publish the lanes' lease cut short (a broker
	// that stopped answering): their unanswered rows stay pending, with no
	// failure recorded, for whoever holds the lanes next.
	Cut uint64
	// LastSuccess is Relay.LastSuccess at the time of the snapshot.
	LastSuccess time.Time
}

// relayStats holds the counters behind Stats.
type relayStats struct {
	published, retried, failed, deadLettered, rounds atomic.Uint64
	lastSuccess                                      atomic.Int64 // unix ns; 0: none yet
}

// endRound records the end of a round: failures rows failed to publish,
// err is its error, if any.
func (s *relayStats) endRound(failures int, err error) {
	s.rounds.Add(1)
	if failures == 0 && err == nil {
		s.lastSuccess.Store(time.Now().UnixNano())
	}
}

// LastSuccess returns the end of the relay's last round that claimed,
// published and marked without an error, an empty round included: a
// relay whose LastSuccess keeps advancing reaches its database and its
// broker. It is the zero time before the first such round.
func (r *Relay) LastSuccess() time.Time {
	ns := r.stats.lastSuccess.Load()
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// Stats returns the relay's counters. It is safe for concurrent use.
func (r *Relay) Stats() Stats {
	return Stats{
		Published:    r.stats.published.Load(),
		Retried:      r.stats.retried.Load(),
		Failed:       r.stats.failed.Load(),
		DeadLettered: r.stats.deadLettered.Load(),
		Rounds:       r.stats.rounds.Load(),
		Cut:          uint64(r.cutBatches.Load()),
		LastSuccess:  r.LastSuccess(),
	}
}
