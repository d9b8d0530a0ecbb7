package main

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/cli/clitest"
)

// Every millwright command line the README and docs/ show (in code spans
// and code blocks) names commands that exist and flags those commands
// have, so that a renamed command or flag fails here, not in an
// operator's shell.
func TestDocsNameRealCommandsAndFlags(t *testing.T) { // not parallel: the global rootCmd
	seen := clitest.CheckDocs(t, rootCmd, filepath.Join("..", ".."))
	t.Logf("%d command lines checked", seen)
	require.Greater(t, seen, 40, "the docs' command lines were found")
}
