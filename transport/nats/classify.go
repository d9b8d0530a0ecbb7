package nats

import (
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/transport"
)

// classifyAdmin marks the errors of creating a stream or consumer that no
// retry fixes as failure.Permanent: a name the server refuses
// (transport.ErrInvalidName), a server or account without JetStream.
func classifyAdmin(err error) error {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, jetstream.ErrInvalidStreamName), errors.Is(err, jetstream.ErrInvalidConsumerName), errors.Is(err, jetstream.ErrInvalidSubject):
		return failure.Permanent(fmt.Errorf("%w: %w", transport.ErrInvalidName, err))
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
		return failure.Permanent(fmt.Errorf("%w (start nats-server with -js, or enable JetStream for the account)", err))
	case errors.As(err, &apiErr) && apiErr.Code == 400:
		return failure.Permanent(err)
	}
	return err
}
