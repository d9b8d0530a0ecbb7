package transport_test

import (
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
		if err != nil {
			if strings.Contains(raw, "secretpw") && strings.Contains(err.Error(), "secretpw") {
				t.Fatalf("error shows the password: %v", err)
			}
			return
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("ParseURL accepted %q but Validate refuses it: %v", raw, err)
		}
		if strings.Contains(raw, ":secretpw@") && strings.Contains(cfg.String(), "secretpw") {
			t.Fatalf("String shows the password: %s", cfg.String())
		}
	})
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
