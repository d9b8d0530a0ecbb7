package millwright

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/metrics"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/transport"
)

// ParticipantFunc applies a saga command (a step's, or its
// compensation's) in tx and returns the reply's payload. It answers
// success by returning nil, a refusal (the step cannot succeed: the saga
// compensates) by returning Refuse(reason), and any other error to be
// retried like a handler's.
type ParticipantFunc func(ctx context.Context, tx postgres.Tx, cmd *message.Message) (reply any, err error)

// refusal is the error of Refuse.
type refusal struct{ reason string }

func (r *refusal) Error() string { return "refused: " + r.reason }

// Refuse is what a ParticipantFunc returns when the command cannot
// succeed: the client answers the step's failure reply (the compensation's
// compensation_failed) with reason as metadata.SagaError, in tx, whose
// writes commit.
func Refuse(reason string) error { return &refusal{reason: reason} }

// Participant registers a saga participant: handler name consumes the
// commands on topic (like Handle) and answers each, through the outbox
// in the transaction of its effect, with the step's default reply type
// (Step.SuccessReply's default "<step>.succeeded", "<step>.failed",
// "<step>.compensated", "<step>.compensation_failed"). A participant of
// steps with other reply types uses Handle and saga.ReplyEvent.
func (c *Client) Participant(name, topic string, h ParticipantFunc, cfg HandlerConfig) error {
	if cfg.AtLeastOnce {
		return fmt.Errorf("millwright: participant %q: AtLeastOnce: a participant answers in its idempotency transaction; use Handle", name)
	}
	return c.Handle(name, topic, func(ctx context.Context, tx postgres.Tx, cmd *message.Message) error {
		reply, err := h(ctx, tx, cmd)
		var refused *refusal
		if err != nil && !errors.As(err, &refused) {
			return err
		}
		ev, err := saga.ReplyEvent(cmd, replyType(cmd, refused == nil), reply)
		if err != nil {
			return err
		}
		if refused != nil {
			ev.Metadata[metadata.SagaError] = refused.reason
		}
		return c.Add(ctx, tx, ev)
	}, cfg)
}

// replyType is the default reply type of command cmd.
func replyType(cmd *message.Message, ok bool) string {
	step := cmd.Metadata.Get(metadata.SagaStep)
	switch {
	case cmd.Metadata.Get(metadata.SagaPhase) == saga.PhaseCompensation && ok:
		return step + ".compensated"
	case cmd.Metadata.Get(metadata.SagaPhase) == saga.PhaseCompensation:
		return step + ".compensation_failed"
	case ok:
		return step + ".succeeded"
	}
	return step + ".failed"
}

// AddSaga registers a saga type on c and returns its orchestrator (start
// sagas with its Start, in the business transaction). Run consumes its
// reply topics (handlers def.Name()+".replies", "…replies_1", …, behind
// the framework's middlewares) and runs its deadlines loop. cfg's
// Registerer, Logger and Source default to the client's; its
// CloseTimeout to 2 s (Run drains it within Config.Grace).
func AddSaga[D any](c *Client, def *saga.Definition[D], cfg saga.Config) (*saga.Orchestrator[D], error) {
	if def == nil {
		return nil, errors.New("millwright: AddSaga: definition is nil: build one with saga.Define")
	}
	if cfg.Registerer == nil {
		cfg.Registerer = c.cfg.Registry
	}
	if cfg.Logger == nil {
		cfg.Logger = c.wlog
	}
	if cfg.Source == "" {
		cfg.Source = "/" + c.cfg.Name
	}
	if cfg.CloseTimeout == 0 {
		cfg.CloseTimeout = graceMargin
	}
	o, err := saga.NewOrchestrator(c.db, def, cfg)
	if err != nil {
		return nil, err
	}
	for i, topic := range o.ReplyTopics() {
		name := def.Name() + ".replies"
		if i > 0 {
			name += "_" + strconv.Itoa(i)
		}
		if err := c.addRoute(route{name: name, topic: topic, idempotent: true, handle: o.HandleReply}); err != nil {
			return nil, err
		}
	}
	c.health.Add("saga "+def.Name(), health.Orchestrator(o))
	return o, c.addPart(part{name: "saga orchestrator " + def.Name(), run: o.Run, running: o.Running(), close: o.Close})
}

// components adds the relay and the cleaners to the parts Run starts,
// and the collectors of the dead letters and parked keys.
func (c *Client) components(tr *transport.Transport) error {
	dead, parked := dlq.NewStore(c.db), park.NewStore(c.db)
	var err error
	metrics.Into(c.cfg.Registry, dlq.NewDepthCollector(dead), &err)
	metrics.Into(c.cfg.Registry, park.NewCollector(parked), &err)
	if err != nil {
		return fmt.Errorf("millwright: registering metrics: %w", err)
	}
	if !c.cfg.NoRelay {
		rc := c.cfg.Relay
		if rc.Logger == nil {
			rc.Logger = c.wlog
		}
		if rc.Registerer == nil {
			rc.Registerer = c.cfg.Registry
		}
		if rc.ListenURL == "" {
			rc.ListenURL = c.cfg.DatabaseURL
		}
		if rc.CloseTimeout == 0 {
			rc.CloseTimeout = graceMargin
		}
		rl, err := relay.New(c.db, tr.Publisher(), rc)
		if err != nil {
			return fmt.Errorf("millwright: relay: %w", err)
		}
		c.parts = append(c.parts, part{name: "outbox relay", run: rl.Run, running: rl.Running(), close: rl.Close})
		c.health.Add("relay", health.Relay(rl, max(time.Minute, 10*rc.PollInterval)))
	}
	for _, cl := range []struct {
		table     string
		retention time.Duration
		open      func(postgres.DB, retention.Config) (*retention.Cleaner, error)
	}{
		{"outbox", c.cfg.Retention.Outbox, retention.NewOutboxCleaner},
		{"idempotency", c.cfg.Retention.Idempotency, retention.NewIdempotencyCleaner},
		{"dead letters", c.cfg.Retention.DeadLetters, retention.NewDeadLetterCleaner},
		{"sagas", c.cfg.Retention.Sagas, retention.NewSagaCleaner},
	} {
		if cl.retention == -1 {
			continue
		}
		k, err := cl.open(c.db, retention.Config{Retention: cl.retention, Logger: c.wlog, CloseTimeout: graceMargin})
		if err != nil {
			return fmt.Errorf("millwright: %s cleaner: %w", cl.table, err)
		}
		c.parts = append(c.parts, part{name: cl.table + " cleaner", run: k.Run, running: k.Running(), close: k.Close})
	}
	return nil
}
