package metadata

// Saga keys: the saga orchestrator writes them on every command it sends,
// and a participant copies them onto its reply (saga.NewReply and
// saga.ReplyEvent do), so the orchestrator can match the reply to the saga
// instance, the step and the attempt it answers.
const (
	// SagaID is the saga instance id.
	SagaID = "saga_id"
	// SagaType is the saga definition's name.
	SagaType = "saga_type"
	// SagaStep is the name of the step the command belongs to.
	SagaStep = "saga_step"
	// SagaPhase is "forward" for a step's command and "compensation" for
	// its compensation command.
	SagaPhase = "saga_phase"
	// SagaAttempt is the attempt number (1-based, decimal) of a compensation
	// command; forward commands carry 1. A reply to an older attempt is
	// recorded as late and ignored.
	SagaAttempt = "saga_attempt"
	// SagaReplyTo is the topic the orchestrator consumes replies from.
	SagaReplyTo = "saga_reply_to"
	// SagaReplyType is set on replies: the step's success or failure reply
	// type. When it is absent the orchestrator reads EventType.
	SagaReplyType = "saga_reply_type"
	// SagaError is set on failure replies: why the participant failed. It is
	// recorded in the saga's step history.
	SagaError = "saga_error"
)
