package outbox

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/metadata"
)

// EnvServiceName is the environment variable naming the service: "/" +
// its value is the default CloudEvents source (see WriterConfig.Source).
const EnvServiceName = "MILLWRIGHT_SERVICE_NAME"

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
		return fmt.Errorf("%w: the CloudEvents source is empty: set Event.Source, outbox.WriterConfig.Source or %s (e.g. orders-service)", ErrInvalidEvent, EnvServiceName)
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
