package outbox

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/metadata"
)

// EnvServiceName is the environment variable naming the service: "/" +
// its value is the default CloudEvents source (see DefaultSource).
const EnvServiceName = "MILLWRIGHT_SERVICE_NAME"

var defaultSource atomic.Pointer[string]

// SetDefaultSource sets the CloudEvents source of events written without
// Event.Source, for the whole process: a URI-reference such as
// "/orders-service" or "https://example.com/orders". Call it once at start-up.
// It returns an error, naming the fix, for an empty source or one that is
// not a URI-reference, and then leaves the default unchanged.
func SetDefaultSource(source string) error {
	if err := checkSource(source); err != nil {
		return fmt.Errorf("outbox: SetDefaultSource: %w", err)
	}
	defaultSource.Store(&source)
	return nil
}

// DefaultSource returns the CloudEvents source (metadata.EventSource) of
// events written without Event.Source, so that every event the relay
// publishes is valid CloudEvents 1.0, which requires a source. In order:
// the value given to SetDefaultSource; "/" + $MILLWRIGHT_SERVICE_NAME; "/"
// + the program's file name (os.Args[0]), as a last resort that is valid
// but says little: name your service.
func DefaultSource() string {
	if p := defaultSource.Load(); p != nil {
		return *p
	}
	env := os.Getenv(EnvServiceName)
	if c := derivedSource.Load(); c != nil && c.env == env {
		return c.source
	}
	src := sourceFromName(env)
	derivedSource.Store(&envSource{env: env, source: src})
	return src
}

// envSource is the default source derived from a value of
// $MILLWRIGHT_SERVICE_NAME, kept so that each write does not derive it
// again (os.Args[0] does not change; the variable may, in tests).
type envSource struct{ env, source string }

var derivedSource atomic.Pointer[envSource]

// sourceFromName is "/" + the service name env (trimmed), else the
// program's file name, escaped into a URI-reference if need be.
func sourceFromName(env string) string {
	name := strings.TrimSpace(env)
	if name == "" && len(os.Args) > 0 {
		name = filepath.Base(os.Args[0])
	}
	if name == "" || name == "." {
		name = "millwright"
	}
	src := "/" + strings.TrimPrefix(name, "/")
	if checkSource(src) != nil {
		src = "/" + url.PathEscape(strings.TrimPrefix(name, "/"))
	}
	return src
}

func checkSource(src string) error {
	if src == "" {
		return fmt.Errorf("%w: the CloudEvents source is empty: set Event.Source, outbox.SetDefaultSource or %s (e.g. orders-service)", ErrInvalidEvent, EnvServiceName)
	}
	if _, err := url.Parse(src); err != nil {
		return fmt.Errorf("%w: the CloudEvents source %q is not a URI-reference: use a path such as \"/orders-service\" or an absolute URI", ErrInvalidEvent, src)
	}
	return nil
}

// validateCloudEvent refuses, at write time, an event the relay would
// publish as invalid CloudEvents 1.0: its stored metadata md (which holds
// the source and any attribute the writer set) plus the attributes the
// relay derives from the row.
func validateCloudEvent(ev Event, md map[string]string) error {
	err := cloudevent.ValidateFunc(ev.ID, func(k string) (string, bool) {
		if k == metadata.EventID {
			return ev.ID, true // the event_id column is authoritative
		}
		if v, ok := md[k]; ok && strings.HasPrefix(k, "ce_") {
			return v, true
		}
		switch k {
		case metadata.EventSpecVersion:
			return cloudevent.SpecVersion, true
		case metadata.EventType:
			return ev.EventType, true
		case metadata.EventTime:
			return zeroEventTime, true // created_at, not known yet
		}
		return "", false
	})
	if err != nil {
		return fmt.Errorf("%w: not a valid CloudEvent (every published event must be): %v", ErrInvalidEvent, err)
	}
	return nil
}

var zeroEventTime = time.Time{}.Format(time.RFC3339)
