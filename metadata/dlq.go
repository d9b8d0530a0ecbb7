package metadata

// Dead-letter keys: the dlq middleware writes them on every message it parks
// on a dead-letter topic, next to the original message's own metadata (which
// it keeps, trace context included). Times are RFC 3339 with nanoseconds.
const (
	// DeadLetterPrefix starts every dead-letter key; replay strips keys
	// with it so a replayed message carries only its original metadata.
	DeadLetterPrefix = "dlq_"
	// DeadLetterOriginalTopic is the topic the message was consumed from.
	DeadLetterOriginalTopic = "dlq_original_topic"
	// DeadLetterTopic is the dead-letter topic the message was published to.
	DeadLetterTopic = "dlq_topic"
	// DeadLetterConsumerGroup is the consumer group that gave up on it.
	DeadLetterConsumerGroup = "dlq_consumer_group"
	// DeadLetterHandler is the Watermill handler name that gave up on it.
	DeadLetterHandler = "dlq_handler"
	// DeadLetterReason is why it was parked: "exhausted", "permanent",
	// "malformed" or "panic".
	DeadLetterReason = "dlq_reason"
	// DeadLetterError is the last error's text.
	DeadLetterError = "dlq_error"
	// DeadLetterErrorType is the Go type of the last error ("*json.SyntaxError").
	DeadLetterErrorType = "dlq_error_type"
	// DeadLetterStack is the stack of the panic, when the last attempt panicked.
	DeadLetterStack = "dlq_stack"
	// DeadLetterAttempts is the number of attempts made, in decimal.
	DeadLetterAttempts = "dlq_attempts"
	// DeadLetterFirstFailure is when the first attempt failed.
	DeadLetterFirstFailure = "dlq_first_failure"
	// DeadLetterLastFailure is when the last attempt failed.
	DeadLetterLastFailure = "dlq_last_failure"
	// DeadLetterOriginalMessageID is the Watermill UUID of the original message.
	DeadLetterOriginalMessageID = "dlq_original_message_id"
	// DeadLetterReplayOf is set on a replayed message: the id of the
	// millwright_dead_letters row it was replayed from. Replay sets it
	// after stripping the other dead-letter keys.
	DeadLetterReplayOf = "dlq_replay_of"
	// DeadLetterReplayFor is set on a replayed message published to its
	// original topic: the consumer the replay is for, the one whose dead
	// letter it is (dlq.ReplayTarget of the row's consumer group and
	// handler). Every consumer group on the topic receives the replay;
	// those whose dead-lettering middleware (dlq.Middleware, park's
	// Middleware) names another consumer ack it without running their
	// handler, so a group that applied the original does not apply it
	// again once its idempotency marks have expired. Absent when the dead
	// letter records no consumer: every consumer then runs it.
	DeadLetterReplayFor = "dlq_replay_for"
)
