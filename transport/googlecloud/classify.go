package googlecloud

import (
	"errors"
	"fmt"
	"strings"

	"cloud.google.com/go/pubsub"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/transport"
)

// classify marks the publish errors that no retry can fix as
// failure.Permanent, so that the outbox relay fails its row at once, with
// the cause, instead of spending its retry budget on it:
//
//   - a message the client refuses for its size (pubsub.ErrOversizedMessage:
//     over the 10 MB of a publish request) or the service refuses for its
//     size or attributes (InvalidArgument naming a size or limit) wraps
//     transport.ErrMessageTooLarge;
//   - an InvalidArgument naming a name (an invalid topic or attribute
//     name) wraps transport.ErrInvalidName; any other InvalidArgument is
//     permanent too (the same request gets the same answer).
//
// Other errors are returned unchanged.
func classify(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pubsub.ErrOversizedMessage) {
		return failure.Permanent(fmt.Errorf("googlecloud: %w: %w (Pub/Sub takes 10 MB per publish request: store large data elsewhere and send a reference)", transport.ErrMessageTooLarge, err))
	}
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) || se.GRPCStatus().Code() != codes.InvalidArgument {
		return err
	}
	msg := strings.ToLower(se.GRPCStatus().Message())
	if strings.Contains(msg, "size") || strings.Contains(msg, "exceed") || strings.Contains(msg, "too large") || strings.Contains(msg, "too long") || strings.Contains(msg, "limit") {
		return failure.Permanent(fmt.Errorf("googlecloud: %w: %w", transport.ErrMessageTooLarge, err))
	}
	if strings.Contains(msg, "name") {
		return failure.Permanent(fmt.Errorf("googlecloud: %w: %w", transport.ErrInvalidName, err))
	}
	return failure.Permanent(err)
}
