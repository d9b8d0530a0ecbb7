package dlq

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
)

// MalformedError marks a message whose payload cannot be understood (JSON
// that does not decode, a missing required field). Create it with Malformed.
type MalformedError struct {
	// Err says what is wrong with the payload.
	Err error
}

// Error returns the wrapped error's text prefixed with "malformed message".
func (e *MalformedError) Error() string { return "malformed message: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *MalformedError) Unwrap() error { return e.Err }

// Malformed marks err as a malformed payload. The result is also
// failure.Permanent: the message goes straight to the dead-letter topic with
// reason "malformed", without wasting retries. Malformed(nil) is nil.
func Malformed(err error) error {
	if err == nil {
		return nil
	}
	return failure.Permanent(&MalformedError{Err: err})
}

// IsMalformed reports whether err or an error it wraps came from Malformed.
func IsMalformed(err error) bool {
	var m *MalformedError
	return errors.As(err, &m)
}

// DecodeJSON decodes msg's payload into v. A payload that does not decode is
// returned as a Malformed error naming the message, so a handler can return
// it as is and the message is parked at once.
func DecodeJSON(msg *message.Message, v any) error {
	if err := json.Unmarshal(msg.Payload, v); err != nil {
		return Malformed(fmt.Errorf("decoding JSON payload of message %s into %T: %w", msg.UUID, v, err))
	}
	return nil
}
