package runner_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/runner"
)

// A panic in a guarded round is recovered, counted once in the component's
// series, logged with the record's fields and the stack, and returned as a
// *PanicError; a round that returns an error or nil is passed through.
func TestGuardRecoversCountsAndLogs(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	logs := watermill.NewCaptureLogger()
	g, err := runner.NewGuard("test.Loop", reg, logs)
	require.NoError(t, err)
	// A second guard of another component shares the registry's series.
	g2, err := runner.NewGuard("other.Loop", reg, nil)
	require.NoError(t, err)

	boom := errors.New("boom")
	require.ErrorIs(t, g.Do("x", nil, func() error { return boom }), boom)
	require.NoError(t, g.Do("x", nil, func() error { return nil }))

	err = g.Do("on a record", watermill.LogFields{"id": 7}, func() error {
		var s []int
		_ = s[3] // index out of range
		return nil
	})
	require.True(t, runner.IsPanic(err), "%v", err)
	require.Contains(t, err.Error(), "test.Loop: recovered from a panic: runtime error: index out of range")
	var pe *runner.PanicError
	require.ErrorAs(t, err, &pe)
	require.Contains(t, string(pe.Stack), "guard_test.go")

	err = g2.Do("x", nil, func() error { panic(boom) })
	require.ErrorIs(t, err, boom, "a panic with an error unwraps to it")

	require.Equal(t, 1.0, testutil.ToFloat64(g.Panics()))
	require.Equal(t, 1.0, testutil.ToFloat64(g2.Panics()))
	n, err := testutil.GatherAndCount(reg, runner.MetricPanics)
	require.NoError(t, err)
	require.Equal(t, 2, n, "one series per component")

	logged := logs.Captured()[watermill.ErrorLogLevel]
	require.Len(t, logged, 1)
	require.Contains(t, logged[0].Msg, "recovered from a panic on a record")
	require.Equal(t, 7, logged[0].Fields["id"])
	require.Equal(t, "test.Loop", logged[0].Fields["component"])
	require.Contains(t, logged[0].Fields["stack"], "guard_test.go")

	var nilGuard *runner.Guard
	require.ErrorIs(t, nilGuard.Do("x", nil, func() error { return boom }), boom)
}
