package transport_test

import (
	"strings"
	"testing"

	"github.com/millwright/millwright/transport"
)

// FuzzFromEnv feeds arbitrary values to every MILLWRIGHT_ variable: no
// panic, an accepted configuration is valid, and errors and descriptions
// never show the SASL password or a URL's password.
func FuzzFromEnv(f *testing.F) {
	f.Add("kafka", "h1:9092,h2:9092", "SCRAM-SHA-512", "u", "secretpw", "", "3", "")
	f.Add("amqp://u:secretpw@h:5672/", "", "", "", "", "many", "", "a,b")
	f.Add("gcppubsub://p-1?emulator=h:1", "", "", "", "", "", "", "")
	f.Add("rabbit", ",,,", "GSSAPI", "", "secretpw", "-1", "0", ",")
	f.Add("postgres://u:secretpw@h/db", "", "", "", "", "", "", "")
	f.Fuzz(func(t *testing.T, sel, brokers, mech, user, pass, prefetch, partitions, groups string) {
		env := map[string]string{
			transport.EnvTransport: sel, transport.EnvKafkaBrokers: brokers, transport.EnvKafkaSASLMechanism: mech, transport.EnvKafkaSASLUser: user,
			transport.EnvKafkaSASLPassword: pass, transport.EnvAMQPPrefetch: prefetch, transport.EnvKafkaPartitions: partitions, transport.EnvDeclareGroups: groups,
		}
		cfg, err := transport.FromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok && v != "" })
		// Only the seeds' marker is looked for: another password could match
		// fixed error text ("host:port") by coincidence.
		secret := strings.Contains(pass, "secretpw") && !strings.Contains(sel+brokers+mech+user+prefetch+partitions+groups, "secretpw")
		if secret {
			pass = "secretpw"
		}
		if err != nil {
			if secret && strings.Contains(err.Error(), pass) {
				t.Fatalf("error shows the SASL password: %v", err)
			}
			return
		}
		if verr := cfg.Validate(); verr != nil {
			t.Fatalf("FromEnv accepted a configuration Validate refuses: %v", verr)
		}
		if secret && strings.Contains(cfg.String(), pass) {
			t.Fatalf("String shows the SASL password: %s", cfg.String())
		}
	})
}
