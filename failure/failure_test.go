package failure_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
)

func TestPermanent(t *testing.T) {
	t.Parallel()
	base := errors.New("unknown currency")
	err := failure.Permanent(base)
	require.True(t, failure.IsPermanent(err))
	require.Equal(t, "unknown currency", err.Error(), "the wrapper adds no text")
	require.ErrorIs(t, err, base)

	var pe *failure.PermanentError
	require.ErrorAs(t, fmt.Errorf("step: %w", err), &pe)
	require.Same(t, base, pe.Err)

	require.Same(t, err, failure.Permanent(err), "marking twice wraps once")
	require.True(t, failure.IsPermanent(errors.Join(errors.New("context"), err)), "through errors.Join")
	wrapped := fmt.Errorf("x: %w", err)
	require.Same(t, wrapped, failure.Permanent(wrapped), "an already permanent chain is returned as it is")

	require.NoError(t, failure.Permanent(nil))
	require.False(t, failure.IsPermanent(nil))
	require.False(t, failure.IsPermanent(base))
	require.False(t, failure.IsPermanent(context.Canceled))
	require.Equal(t, "permanent error", (&failure.PermanentError{}).Error())
}
