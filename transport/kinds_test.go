package transport_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all" // the tests use every kind
)

// transport/all registers the five kinds.
func TestAllRegistersEveryKind(t *testing.T) {
	t.Parallel()
	require.ElementsMatch(t, transport.Kinds, transport.Registered())
}

// A program that imports only transport gets, for a kind it did not
// import, an error naming the import to add, and links no broker client.
func TestUnlinkedKindNamesTheImport(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds a program")
	}
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(`package main

import (
	"context"
	"fmt"

	"github.com/millwright/millwright/transport"
)

func main() {
	_, err := transport.ParseURL("kafka://127.0.0.1:9092")
	fmt.Println(err)
	_, err = transport.Open(context.Background(), transport.Config{Kind: transport.GoChannel})
	fmt.Println(err)
}
`), 0o644))
	bin := filepath.Join(dir, "onlytransport")
	build := exec.Command("go", "build", "-o", bin, filepath.Join(dir, "main.go"))
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)
	out, err = exec.CommandContext(context.Background(), bin).CombinedOutput()
	require.NoError(t, err, "%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, 2)
	require.Contains(t, lines[0], `import _ "github.com/millwright/millwright/transport/kafka"`)
	require.Contains(t, lines[1], `import _ "github.com/millwright/millwright/transport/gochannel"`)

	deps, err := exec.Command("go", "list", "-deps", filepath.Join(dir, "main.go")).Output()
	require.NoError(t, err)
	for _, client := range []string{"github.com/IBM/sarama", "github.com/rabbitmq/amqp091-go", "cloud.google.com/go/pubsub", "github.com/lib/pq", "github.com/ThreeDotsLabs/watermill-sql", "github.com/nats-io/nats.go"} {
		require.NotContains(t, string(deps), client+"\n", "a program importing only transport links %s", client)
	}
}
