// Package interrupt forwards to the public package shutdown, which holds
// the signal context and its backstop (millwright's commands import it
// under this name).
package interrupt

import (
	"context"
	"time"

	"github.com/millwright/millwright/shutdown"
)

// Grace is shutdown.Grace.
const Grace = shutdown.Grace

// ExtendGrace is shutdown.ExtendGrace.
func ExtendGrace(d time.Duration) { shutdown.ExtendGrace(d) }

// Context is shutdown.Context.
func Context(parent context.Context, name string) (context.Context, context.CancelFunc) {
	return shutdown.Context(parent, name)
}

// Message is shutdown.Message.
func Message(name string, cause error, waited time.Duration, waiting []string) string {
	return shutdown.Message(name, cause, waited, waiting)
}
