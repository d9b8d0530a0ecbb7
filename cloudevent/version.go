package cloudevent

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
)

// ErrUnknownType is returned (wrapped in failure.Permanent, so retry stops
// and the DLQ keeps the message) by a VersionRouter's handler for a
// message whose ce_type has no handler. Deploy a consumer that handles the
// version, then replay the dead letters.
var ErrUnknownType = errors.New("cloudevent: no handler for event type")

// Type returns the versioned event type name+".v"+version
// ("order.created", 2 -> "order.created.v2").
func Type(name string, version int) string {
	return name + ".v" + strconv.Itoa(version)
}

// ParseType splits a versioned event type into its name and version
// ("order.created.v2" -> "order.created", 2). ok is false when typ does
// not end in ".v<N>" with N >= 1.
func ParseType(typ string) (name string, version int, ok bool) {
	i := strings.LastIndex(typ, ".v")
	if i <= 0 {
		return "", 0, false
	}
	v, err := strconv.Atoi(typ[i+2:])
	if err != nil || v < 1 || strconv.Itoa(v) != typ[i+2:] {
		return "", 0, false
	}
	return typ[:i], v, true
}

// VersionRouter routes messages to handlers by their ce_type, so one
// subscription can carry v1 and v2 of an event side by side during a
// breaking change and each version reaches the code that understands it.
// Register handlers before calling Handler; after that it is safe for
// concurrent use.
type VersionRouter struct {
	handlers map[string]message.NoPublishHandlerFunc
	fallback message.NoPublishHandlerFunc
}

// NewVersionRouter returns an empty router.
func NewVersionRouter() *VersionRouter {
	return &VersionRouter{handlers: map[string]message.NoPublishHandlerFunc{}}
}

// Handle routes messages whose ce_type is eventType to h. It returns the
// router, for chaining.
func (r *VersionRouter) Handle(eventType string, h message.NoPublishHandlerFunc) *VersionRouter {
	r.handlers[eventType] = h
	return r
}

// Fallback routes messages of any unregistered type to h (for example one
// that acks and counts events this consumer does not care about). Without a
// fallback such messages fail permanently with ErrUnknownType.
func (r *VersionRouter) Fallback(h message.NoPublishHandlerFunc) *VersionRouter {
	r.fallback = h
	return r
}

// Types lists the registered event types, sorted.
func (r *VersionRouter) Types() []string {
	ts := make([]string, 0, len(r.handlers))
	for t := range r.handlers {
		ts = append(ts, t)
	}
	sort.Strings(ts)
	return ts
}

// Handler returns the routing handler, for message.Router.AddNoPublisherHandler.
func (r *VersionRouter) Handler() message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		typ := msg.Metadata.Get(metadata.EventType)
		if h, ok := r.handlers[typ]; ok {
			return h(msg)
		}
		if r.fallback != nil {
			return r.fallback(msg)
		}
		return failure.Permanent(fmt.Errorf("%w %q (message %s; handled: %s): deploy a consumer for it and replay from the DLQ",
			ErrUnknownType, typ, msg.UUID, strings.Join(r.Types(), ", ")))
	}
}
