package dlq

import (
	"fmt"
	"net/url"
	"strings"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/logfields"
	"github.com/millwright/millwright/metadata"
)

// MetricReplaysSkipped counts replayed dead letters a consumer acked
// without running its handler because the replay was for another consumer
// (metadata.DeadLetterReplayFor), by topic and the skipping consumer's
// consumer group and handler. dlq.Middleware and park's Middleware count
// into it.
const MetricReplaysSkipped = "millwright_dlq_replays_skipped_total"

// ReplayTarget is the metadata.DeadLetterReplayFor value naming the
// consumer whose dead letter a replay is: its consumer group and handler,
// each path-escaped and joined by "/" ("billing/charge"), so neither may
// hold a "/" that makes the pair ambiguous. It is "" when both are empty
// (a dead letter that records no consumer): such a replay is for every
// consumer of its topic.
//
// The identity is the one the dead-lettering middleware records: for
// dlq.Middleware, its Config.ConsumerGroup and the Watermill handler name;
// for park, its Config.ConsumerGroup and the handler name given to
// Parker.Middleware. Two consumers of one topic with the same pair are one
// consumer to a replay: give each service its own Config.ConsumerGroup.
func ReplayTarget(consumerGroup, handler string) string {
	if consumerGroup == "" && handler == "" {
		return ""
	}
	return url.PathEscape(consumerGroup) + "/" + url.PathEscape(handler)
}

// SetReplayFor writes on md, the metadata of a replay published to its
// original topic, which consumer the replay is for:
// metadata.DeadLetterReplayFor = ReplayTarget(consumerGroup, handler), the
// dead letter's recorded consumer. When it records none the key is removed
// (a stored message may carry an older replay's): the replay is for every
// consumer. ReplayTx (the replay of the CLI and the console) calls it.
func SetReplayFor(md map[string]string, consumerGroup, handler string) {
	setReplayFor(md, ReplayTarget(consumerGroup, handler))
}

func setReplayFor(md map[string]string, target string) {
	if target == "" {
		delete(md, metadata.DeadLetterReplayFor)
		return
	}
	md[metadata.DeadLetterReplayFor] = target
}

// ReplayEveryConsumer is the ReplayOptions.For that sends replays to every
// consumer of the topic, whatever consumer their dead letters record.
const ReplayEveryConsumer = "*"

// validReplayFor checks a ReplayOptions.For.
func validReplayFor(target string) error {
	if target == "" || target == ReplayEveryConsumer || strings.Contains(target, "/") {
		return nil
	}
	return fmt.Errorf(`dlq: replay for %q: want "" (the consumer each dead letter records), %q (every consumer of the topic) or "<consumer group>/<handler>" as dlq.ReplayTarget writes it`, target, ReplayEveryConsumer)
}

// replayFor is the target of d's replay to topic, with override the
// ReplayOptions.For: a replay to another topic than the original
// (ReplayOptions.Target) is for whoever consumes that topic.
func (d DeadLetter) replayFor(topic, override string) string {
	switch {
	case topic != d.OriginalTopic, override == ReplayEveryConsumer:
		return ""
	case override != "":
		return override
	}
	return ReplayTarget(d.ConsumerGroup, d.Handler)
}

// ReplayGate recognises the replays that are for another consumer, the
// one check that dlq.Middleware and park's Middleware make before their
// handler: a message whose metadata.DeadLetterReplayFor names a consumer
// other than (consumer group, handler) is counted (MetricReplaysSkipped),
// logged at info level and to be acked without running the handler.
// Every other message, replays for this consumer and replays of dead
// letters that record no consumer included, goes through. Safe for
// concurrent use.
type ReplayGate struct {
	group   string
	logger  watermill.LoggerAdapter
	skipped *prometheus.CounterVec
	n       atomic.Uint64
}

// NewReplayGate returns the gate of the consumers of consumerGroup.
// logger (nil: none) gets one info line per skipped replay; reg (nil:
// none) gets MetricReplaysSkipped.
func NewReplayGate(consumerGroup string, logger watermill.LoggerAdapter, reg prometheus.Registerer) (*ReplayGate, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	g := &ReplayGate{group: consumerGroup, logger: logger}
	if reg != nil {
		var err error
		if g.skipped, err = registerCounter(reg, MetricReplaysSkipped,
			"Replayed dead letters acked without running the handler: the replay was for another consumer.", "topic", "consumer_group", "handler"); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// Skip reports whether msg, consumed by handler, is a replay for another
// consumer; when it is, it counts and logs it.
func (g *ReplayGate) Skip(msg *message.Message, handler string) bool {
	target := msg.Metadata.Get(metadata.DeadLetterReplayFor)
	if target == "" || target == ReplayTarget(g.group, handler) {
		return false
	}
	topic := message.SubscribeTopicFromCtx(msg.Context())
	g.n.Add(1)
	if g.skipped != nil {
		g.skipped.WithLabelValues(topic, g.group, handler).Inc()
	}
	g.logger.Info("Replayed dead letter is for another consumer; acked without running the handler", logfields.Of(topic, msg).Add(watermill.LogFields{
		"consumer_group": g.group, "handler": handler, "replay_for": target,
		"dead_letter_id": msg.Metadata.Get(metadata.DeadLetterReplayOf),
	}))
	return true
}

// Skipped counts the replays Skip skipped.
func (g *ReplayGate) Skipped() uint64 { return g.n.Load() }
