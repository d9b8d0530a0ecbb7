package park

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/logfields"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/retry"
)

// Middleware returns the parking middleware of the handler named handler,
// and registers the handler it wraps with the retrier, which runs it on
// the handler's parked messages. The name scopes the parked keys in the
// database: give every handler (every consumer group's handler of a
// topic) its own, the same in every instance of the service.
//
// Put it outside the in-place retry and the idempotency middleware, and do
// not wrap it in dlq.Middleware (it dead-letters itself):
//
//	h.AddMiddleware(parker.Middleware("billing"), rm.Middleware, dedup.Middleware)
//
// For each message it:
//   - acks it without running the handler when it is a replayed dead
//     letter for another consumer (its metadata.DeadLetterReplayFor names
//     another Config.ConsumerGroup or handler name: dlq.ReplayGate, counted
//     in dlq.MetricReplaysSkipped);
//   - gives a replayed dead letter (metadata.DeadLetterReplayOf) whose
//     message is parked that message's place, without running the
//     handler (acks); nacks it, for redelivery after the round, while that
//     message is its key's head and a retrier's round is running it;
//   - parks it behind its key, without running the handler, when the key
//     is parked (acks);
//   - else runs the handler: success acks (produced messages go to the
//     router); a transient failure after the in-place retries parks the
//     message as its key's head, due after the park policy's first delay,
//     and acks; a permanent failure writes a dead letter (and, with Hold,
//     parks the message as the key's held head) and acks; an interrupted
//     retry (shutdown) nacks;
//   - nacks, for redelivery, when the database does not answer.
//
// A name belongs to one handler: wrapping a second handler under a name
// the Parker already has (two Middleware calls with one name, or one
// Middleware added to the router, which applies it to every handler) is
// refused, loudly: the error is logged, every message of the second
// handler is nacked with it (ErrDuplicateHandler, naming the handler and
// the fix) without running, and Run returns it.
func (p *Parker) Middleware(handler string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		if err := p.register(handler, h); err != nil {
			p.cfg.Logger.Error("Handler not registered with the parker: its messages are nacked", err, watermill.LogFields{"handler": handler})
			return func(*message.Message) ([]*message.Message, error) { return nil, err }
		}
		// Park records (ConsumerGroup, handler) on its dead letters; a
		// replay of another consumer's dead letter is acked unrun.
		replays, err := dlq.NewReplayGate(p.cfg.ConsumerGroup, p.cfg.Logger, p.cfg.Registerer)
		if err != nil {
			p.cfg.Logger.Error("Handler's replay check not set up: its messages are nacked", err, watermill.LogFields{"handler": handler})
			return func(*message.Message) ([]*message.Message, error) { return nil, err }
		}
		return func(msg *message.Message) ([]*message.Message, error) {
			if replays.Skip(msg, handler) {
				return nil, nil
			}
			return p.handle(handler, h, msg)
		}
	}
}

func (p *Parker) handle(handler string, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	pm := p.parkedMessage(handler, message.SubscribeTopicFromCtx(ctx), msg)
	if replaced, err := p.replaceParked(ctx, handler, pm, msg); err != nil || replaced {
		return nil, err
	}
	parked, err := storage.ParkBehind(ctx, p.pool, pm)
	if err != nil {
		return nil, fmt.Errorf("park: handler %q: checking whether key %s is parked (message %s nacked)%s: %w",
			handler, keyText(pm.Key), msg.UUID, storage.Hint(err), err)
	}
	if parked {
		p.countParked(handler, "behind")
		return nil, nil
	}
	produced, herr := callRecovering(h, msg)
	if herr == nil {
		return produced, nil
	}
	if !retry.Final(herr) {
		return nil, herr
	}
	// The decision is made: a shutdown starting now must not turn it into
	// a redelivery of a message that used its in-place attempts.
	wctx := context.WithoutCancel(ctx)
	if failure.IsPermanent(herr) {
		return nil, p.deadLetterFirst(wctx, handler, pm, herr)
	}
	f := dlq.Describe(herr)
	delay := p.cfg.Retry.Delay(1, 0)
	if _, err := storage.ParkHead(wctx, p.pool, pm, storage.ParkFailure{
		DueIn: delay, Attempts: f.Attempts, PrevDelay: delay, FirstFailure: f.FirstFailure, LastFailure: f.LastFailure, LastError: f.Error,
	}); err != nil {
		return nil, errors.Join(herr, fmt.Errorf("park: handler %q: parking message %s of key %s failed, nacked for redelivery: %w", handler, msg.UUID, keyText(pm.Key), err))
	}
	p.countParked(handler, "failed")
	p.cfg.Logger.Info("Message parked; its key waits for the retrier", logfields.Of(pm.Topic, msg).Add(watermill.LogFields{
		"handler": handler, "key": keyText(pm.Key), "attempts": f.Attempts, "due_in": delay.String(), "error": f.Error,
	}))
	return nil, nil
}

// deadLetterFirst records the dead letter of a message that failed
// permanently on first delivery; with Hold its key is held behind it.
func (p *Parker) deadLetterFirst(ctx context.Context, handler string, pm storage.ParkedMessage, cause error) error {
	f := dlq.Describe(cause)
	row := p.deadLetterRow(handler, pm, f)
	id, err := storage.ParkDead(ctx, p.pool, pm, row, p.cfg.OnDeadLetter == Hold, p.recordDeadLetter(handler, pm, f))
	if err != nil {
		return errors.Join(cause, fmt.Errorf("park: handler %q: recording the dead letter of message %s failed, nacked for redelivery%s: %w", handler, pm.MessageUUID, storage.Hint(err), err))
	}
	p.countRetry(handler, "dead_letter")
	p.logDeadLetter(handler, pm, f, id, cause)
	return nil
}

func (p *Parker) logDeadLetter(handler string, pm storage.ParkedMessage, f dlq.Failure, id int64, cause error) {
	p.cfg.Logger.Error("Message dead-lettered", cause, watermill.LogFields{
		"handler": handler, "key": keyText(pm.Key), "message_uuid": pm.MessageUUID, "topic": pm.Topic, "reason": f.Reason,
		"attempts": f.Attempts, "dead_letter_id": id, "on_dead_letter": string(p.cfg.OnDeadLetter),
	})
}

// recordDeadLetter writes the dead letter of pm with dlq.RecordTx, the one
// writer of dead letters, in park's transaction (the one that holds the
// key, or drops the head): every dead letter has its fields filled the
// same way, whoever gave up. A replay finds the parked copy by its id.
func (p *Parker) recordDeadLetter(handler string, pm storage.ParkedMessage, f dlq.Failure) storage.RecordDeadLetter {
	md, err := storage.DecodeParkedMetadata(pm.Metadata)
	if err != nil {
		md = map[string]string{"millwright_park_metadata_error": err.Error()}
	}
	d := dlq.DeadLetter{
		MessageUUID: pm.MessageUUID, OriginalTopic: pm.Topic, DeadLetterTopic: p.cfg.DeadLetterTopic(pm.Topic),
		ConsumerGroup: p.cfg.ConsumerGroup, Handler: handler, Reason: f.Reason, Error: f.Error, ErrorType: f.ErrorType,
		Stack: f.Stack, Attempts: f.Attempts, FirstFailure: f.FirstFailure, LastFailure: f.LastFailure,
		Payload: pm.Payload, Metadata: md,
	}
	return func(ctx context.Context, tx storage.Tx) (int64, error) {
		return dlq.RecordTx(ctx, storage.TxOf(tx), d)
	}
}

// deadLetterRow is the key state's view of pm's dead letter (its handler,
// attempts, failure times and error), which DeadLetterParked copies onto
// the held key; the row itself is written by recordDeadLetter.
func (p *Parker) deadLetterRow(handler string, pm storage.ParkedMessage, f dlq.Failure) storage.DeadLetterRow {
	md, err := storage.DecodeParkedMetadata(pm.Metadata)
	if err != nil {
		md = map[string]string{"millwright_park_metadata_error": err.Error()}
	}
	mdJSON, err := json.Marshal(storableMetadata(md))
	if err != nil {
		mdJSON = []byte("{}")
	}
	return storage.DeadLetterRow{
		MessageUUID: storable(pm.MessageUUID), OriginalTopic: pm.Topic, DLQTopic: storable(p.cfg.DeadLetterTopic(pm.Topic)),
		ConsumerGroup: storable(p.cfg.ConsumerGroup), Handler: storable(handler), Reason: f.Reason, Error: storable(f.Error), ErrorType: storable(f.ErrorType),
		Stack: storable(f.Stack), Attempts: f.Attempts, FirstFailure: f.FirstFailure, LastFailure: f.LastFailure,
		Payload: pm.Payload, Metadata: string(mdJSON), MessageUUIDRaw: pm.MessageUUID, MetadataRaw: storage.EncodeParkedMetadata(md),
	}
}

// parkedMessage is msg as a row: its lane (its key's bytes, or for a
// message without a key its UUID, in a lane no key shares), topic and
// metadata, byte for byte.
func (p *Parker) parkedMessage(handler, topic string, msg *message.Message) storage.ParkedMessage {
	key := p.cfg.Key(msg)
	lane := storage.ParkLane(key, false)
	if key == "" {
		lane = storage.ParkLane(msg.UUID, true)
	}
	return storage.ParkedMessage{Handler: handler, Key: lane, MessageUUID: msg.UUID, Topic: storable(topic),
		Payload: msg.Payload, Metadata: storage.EncodeParkedMetadata(msg.Metadata)}
}

// keyText is a lane as logs and errors show it: the key quoted (a binary
// key's bytes escaped), or the keyless message's UUID.
func keyText(lane string) string {
	key, keyless := storage.SplitParkLane(lane)
	if keyless {
		return fmt.Sprintf("(no key: message %q)", key)
	}
	return fmt.Sprintf("%q", key)
}

// keepBytes is the metadata of a replay to store in place of its parked
// copy's (stored, EncodeParkedMetadata's form): the replay's, except that
// an entry the dead-letter table only turned into text (bytes that are not
// UTF-8 replaced with U+FFFD: a binary key or header) keeps the parked
// copy's bytes. An entry the operator edited takes the edit. Since dlq
// migration 005 a replay carries the bytes and this changes nothing; it
// stays for dead letters recorded before it, whose text lost them.
func keepBytes(stored []byte, replay message.Metadata) []byte {
	parked, err := storage.DecodeParkedMetadata(stored)
	if err != nil {
		return storage.EncodeParkedMetadata(replay)
	}
	asText := make(map[string]string, len(parked))
	for k := range parked {
		if sk := storable(k); sk != k {
			asText[sk] = k
		}
	}
	out := make(map[string]string, len(replay))
	for k, v := range replay {
		orig := k
		if _, ok := parked[k]; !ok {
			if o, ok := asText[k]; ok {
				orig = o
			}
		}
		if pv, ok := parked[orig]; ok && storable(pv) == v {
			out[orig] = pv
			continue
		}
		out[k] = v
	}
	return storage.EncodeParkedMetadata(out)
}

// replaceParked applies a replayed dead letter (metadata
// DeadLetterReplayOf, set by `millwright dlq replay` and the console's
// replay and edit) in its parked message's place: the parked message of
// that dead letter (a held head, usually), else the parked message with
// its UUID, takes the replay's payload and metadata, and a held head is
// released from the hold, due at once. Without that, a replay keeping
// the original UUID would be taken for a redelivery of the parked copy
// and acked, and the operator's fix dropped. replaced is false when no
// parked message matches: the replay then goes through like any message.
// While the matched message is its key's head and a retrier's round runs
// it (storage.ErrParkedHeadRunning), the replay is nacked: the broker
// redelivers it after the round, which either failed (the replay then
// takes the head's place) or applied the head (the replay then runs as a
// new message).
func (p *Parker) replaceParked(ctx context.Context, handler string, pm storage.ParkedMessage, msg *message.Message) (bool, error) {
	of := msg.Metadata.Get(metadata.DeadLetterReplayOf)
	if of == "" {
		return false, nil
	}
	id, err := strconv.ParseInt(of, 10, 64)
	if err != nil {
		id = 0 // not a dead letter id: match by UUID only
	}
	r, err := storage.ReplaceParked(ctx, p.pool, handler, id, pm, func(parked []byte) []byte { return keepBytes(parked, msg.Metadata) })
	if err != nil {
		return false, fmt.Errorf("park: handler %q: giving replayed dead letter %s (message %s) its parked message's place (nacked)%s: %w",
			handler, of, msg.UUID, storage.Hint(err), err)
	}
	if !r.Replaced {
		return false, nil
	}
	p.countParked(handler, "replaced")
	p.cfg.Logger.Info("Replayed dead letter took its parked message's place", watermill.LogFields{
		"handler": handler, "key": keyText(r.Key), "message_uuid": msg.UUID, "dead_letter_id": of, "released_hold": r.Released,
	})
	if r.Released {
		p.poke()
	}
	return true, nil
}

// errPanicked marks the error callRecovering makes of a panic.
var errPanicked = errors.New("park: handler panicked")

// callRecovering calls h, turning a panic into an error wrapping
// errPanicked, with the stack (the retry middleware inside usually
// recovers first).
func callRecovering(h message.HandlerFunc, msg *message.Message) (produced []*message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			produced, err = nil, fmt.Errorf("%w: %v\n%s", errPanicked, r, debug.Stack())
		}
	}()
	return h(msg)
}

// since is time.Since of a failure time that may be unset.
func since(t time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return time.Since(t)
}
