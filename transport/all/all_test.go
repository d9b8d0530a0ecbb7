package all_test

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all"
)

// transport/all registers the five real kinds and links no development
// fake: a program that offers kfake or pstest imports transport/embedded.
func TestAllLinksEveryKindAndNoFake(t *testing.T) {
	t.Parallel()
	for _, k := range []transport.Kind{transport.Kafka, transport.AMQP, transport.GoogleCloud, transport.SQL, transport.GoChannel} {
		cfg := transport.Config{Kind: k}
		err := cfg.Validate()
		if err != nil {
			require.NotContains(t, err.Error(), "not linked into this program", "kind %s", k)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "list", "-deps", ".").Output()
	require.NoError(t, err, "go list -deps ./transport/all")
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "github.com/millwright/millwright/transport/kafka")
	for _, dep := range deps {
		for _, fake := range []string{"github.com/twmb/franz-go/pkg/kfake", "cloud.google.com/go/pubsub/pstest", "github.com/millwright/millwright/transport/embedded"} {
			if dep == fake || strings.HasPrefix(dep, fake+"/") {
				t.Errorf("transport/all links %s: the fakes are linked by importing transport/embedded only", dep)
			}
		}
	}
}
