package saga

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
)

// replyKeys are the command's saga keys a reply must carry back.
var replyKeys = []string{metadata.SagaID, metadata.SagaType, metadata.SagaStep, metadata.SagaPhase, metadata.SagaAttempt}

// ReplyTopic returns the topic a participant must send its reply to
// command cmd to (metadata.SagaReplyTo).
func ReplyTopic(cmd *message.Message) string { return cmd.Metadata.Get(metadata.SagaReplyTo) }

// IsCommand reports whether msg is a saga command (it has metadata.SagaID).
func IsCommand(msg *message.Message) bool { return msg.Metadata.Get(metadata.SagaID) != "" }

// ReplyEvent returns the reply to command cmd as an outbox event, for a
// participant that writes its effect and its reply in one transaction (the
// way to answer exactly once per effect):
//
//	ev, err := saga.ReplyEvent(cmd, "reserve.succeeded", reservation)
//	err = outbox.Add(ctx, tx, ev)
//
// replyType is one of the step's reply types (Step.SuccessReply, ...);
// payload is marshalled with encoding/json ([]byte is sent as is). For a
// failure reply, set ev.Metadata[metadata.SagaError] to the reason: it is
// recorded in the saga's history.
func ReplyEvent(cmd *message.Message, replyType string, payload any) (outbox.Event, error) {
	topic := ReplyTopic(cmd)
	if topic == "" || !IsCommand(cmd) {
		return outbox.Event{}, fmt.Errorf("saga: replying to message %s: it has no %q or %q metadata: is it a saga command?", cmd.UUID, metadata.SagaID, metadata.SagaReplyTo)
	}
	body, err := marshalPayload(payload)
	if err != nil {
		return outbox.Event{}, fmt.Errorf("saga: replying to %s: %w", cmd.UUID, err)
	}
	md := make(map[string]string, len(replyKeys)+1)
	for _, k := range replyKeys {
		md[k] = cmd.Metadata.Get(k)
	}
	md[metadata.SagaReplyType] = replyType
	sagaID := cmd.Metadata.Get(metadata.SagaID)
	return outbox.Event{Topic: topic, AggregateType: "saga", AggregateID: sagaID, EventType: replyType, Payload: body, Metadata: md}, nil
}

// NewReply returns the reply to command cmd as a message with a fresh
// event id, to publish on ReplyTopic(cmd). Prefer ReplyEvent with the
// outbox when the participant has a database effect.
func NewReply(cmd *message.Message, replyType string, payload any) (*message.Message, error) {
	ev, err := ReplyEvent(cmd, replyType, payload)
	if err != nil {
		return nil, err
	}
	id := uuid.NewString()
	msg := message.NewMessage(id, ev.Payload)
	for k, v := range ev.Metadata {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(metadata.EventID, id)
	msg.Metadata.Set(metadata.EventType, replyType)
	msg.Metadata.Set(metadata.OrderingKey, "saga/"+ev.AggregateID)
	return msg, nil
}

func marshalPayload(p any) ([]byte, error) {
	switch v := p.(type) {
	case nil:
		return []byte("{}"), nil
	case []byte:
		return v, nil
	case json.RawMessage:
		return v, nil
	}
	b, err := json.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("marshalling payload %T: %w", p, err)
	}
	return b, nil
}

// parseReply reads and checks what reply msg says about itself.
func (d decider[D]) parseReply(msg *message.Message) (replyInfo, error) {
	var r replyInfo
	md := msg.Metadata
	r.sagaID = md.Get(metadata.SagaID)
	if r.sagaID == "" {
		return r, fmt.Errorf("saga %s: reply %s has no %q metadata: participants must copy the command's saga keys (use saga.NewReply or saga.ReplyEvent)", d.def.name, msg.UUID, metadata.SagaID)
	}
	if storableText(r.sagaID) != r.sagaID {
		// Saga ids are stored as text: this one cannot name a saga.
		return r, fmt.Errorf("saga %s: reply %s has %s %q that is not valid UTF-8 or holds a NUL byte: no saga has that id", d.def.name, msg.UUID, metadata.SagaID, r.sagaID)
	}
	if typ := md.Get(metadata.SagaType); typ != "" && typ != d.def.name {
		return r, fmt.Errorf("saga %s: reply %s is for saga type %q: give each saga type its own reply topic (Config.ReplyTopic)", d.def.name, msg.UUID, typ)
	}
	r.step, r.phase = md.Get(metadata.SagaStep), md.Get(metadata.SagaPhase)
	idx, ok := d.def.index[r.step]
	if !ok {
		return r, fmt.Errorf("saga %s %q: reply %s names unknown step %q: want one of %s", d.def.name, r.sagaID, msg.UUID, r.step, strings.Join(d.def.Steps(), ", "))
	}
	r.stepIdx = idx
	if r.phase != PhaseForward && r.phase != PhaseCompensation {
		return r, fmt.Errorf("saga %s %q: reply %s has %s %q: want %q or %q", d.def.name, r.sagaID, msg.UUID, metadata.SagaPhase, r.phase, PhaseForward, PhaseCompensation)
	}
	att, err := strconv.Atoi(md.Get(metadata.SagaAttempt))
	if err != nil || att < 1 {
		return r, fmt.Errorf("saga %s %q: reply %s has %s %q: want a positive integer copied from the command", d.def.name, r.sagaID, msg.UUID, metadata.SagaAttempt, md.Get(metadata.SagaAttempt))
	}
	r.attempt = att
	r.reply = Reply{Type: md.Get(metadata.SagaReplyType), Payload: msg.Payload, Metadata: map[string]string(md)}
	if r.reply.Type == "" {
		r.reply.Type = md.Get(metadata.EventType)
	}
	s := d.def.steps[idx]
	if s.isTimer() { // wait.go
		return r, d.timerReplyError(r)
	}
	want := []string{s.SuccessReply, s.FailureReply}
	if r.phase == PhaseCompensation {
		want = []string{s.CompensatedReply, s.CompensationFailedReply}
	}
	if r.reply.Type != want[0] && r.reply.Type != want[1] {
		return r, fmt.Errorf("saga %s %q: step %q %s reply %s has type %q: want %q or %q (set %s)",
			d.def.name, r.sagaID, r.step, r.phase, msg.UUID, r.reply.Type, want[0], want[1], metadata.SagaReplyType)
	}
	return r, nil
}
