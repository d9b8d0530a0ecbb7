package transport_test

import (
	"net/url"
	"strings"
	"testing"

	"github.com/millwright/millwright/transport"
)

// FuzzParseURL: no input panics, and an accepted URL yields a valid
// configuration whose description never shows the password.
func FuzzParseURL(f *testing.F) {
	for _, s := range []string{
		"kafka://h1:9092,h2:9092", "kafka://u:secretpw@h:9093?sasl=SCRAM-SHA-512&tls=true",
		"amqp://guest:secretpw@localhost:5672/vhost", "amqps://u:p@h:5671/", "gcppubsub://proj?emulator=localhost:8085",
		"postgres://u:secretpw@h:5432/db?sslmode=require", "mem://", "kafka://", "kafka://@", "kafka://:@,,,?%zz",
		"amqp://%", "gcppubsub://", "://", "postgres://[::1", "kafka://a:1?ca_file=/nonexistent",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		cfg, err := transport.ParseURL(raw)
		secret := urlPassword(raw)
		if err != nil {
			if secret != "" && strings.Contains(err.Error(), secret) {
				t.Fatalf("error shows the password %q: %v", secret, err)
			}
			return
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("ParseURL accepted %q but Validate refuses it: %v", raw, err)
		}
		if secret != "" && strings.Contains(cfg.String(), secret) {
			t.Fatalf("String shows the password %q: %s", secret, cfg.String())
		}
	})
}

// urlPassword returns the password of raw's userinfo (scheme://user:pass@...)
// when it is long enough to be told apart and appears nowhere else in raw,
// so that a host or path equal to it is not mistaken for a leak.
func urlPassword(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return ""
	}
	var pass string
	if strings.EqualFold(scheme, "kafka") {
		// ParseURL's own reading: userinfo ends at the last '@' before '?'.
		rest, _, _ = strings.Cut(rest, "?")
		at := strings.LastIndex(rest, "@")
		if at < 0 {
			return ""
		}
		if _, pass, ok = strings.Cut(rest[:at], ":"); !ok {
			return ""
		}
	} else {
		u, err := url.Parse(raw)
		if err != nil || u.User == nil {
			return ""
		}
		if pass, ok = u.User.Password(); !ok {
			return ""
		}
	}
	// Only the seeds' marker is looked for: any other string can appear in
	// the output by coincidence (a host, an escaped path), but "secretpw"
	// once in the input, and only in the password, cannot.
	const marker = "secretpw"
	if !strings.Contains(pass, marker) || strings.Count(raw, marker) != 1 {
		return ""
	}
	return marker
}

// FuzzValidateName: no panic, and an accepted name has only allow-listed bytes.
func FuzzValidateName(f *testing.F) {
	for _, s := range []string{"orders", "a.b-c_d", `x"; DROP TABLE y; --`, "../x", "", "\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		for _, kind := range transport.Kinds {
			if transport.ValidateName(kind, "topic", name) != nil {
				continue
			}
			for _, r := range name {
				if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
					t.Fatalf("%s accepted %q with byte %q", kind, name, r)
				}
			}
		}
	})
}
