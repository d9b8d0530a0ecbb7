package health_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/health"
)

// While the process waits for its broker, readiness fails saying so, with
// the last failure; once the wait is over it passes.
func TestWaiterSaysWhatTheProcessWaitsFor(t *testing.T) {
	t.Parallel()
	h, err := health.NewHandler(health.Config{})
	require.NoError(t, err)
	w := health.Waiting("the broker")
	h.Add("broker", w)

	rep := h.Check(context.Background())
	require.False(t, rep.Ready)
	require.ErrorIs(t, rep.Err(), health.ErrWaiting)
	require.Contains(t, rep.String(), "[-]broker failed: waiting for the broker")

	w.Failed(errors.New("dial tcp 127.0.0.1:9092: connection refused"))
	w.Failed(errors.New("dial tcp 127.0.0.1:9092: connection refused"))
	rec := httptest.NewRecorder()
	h.Ready().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, health.PathReady, nil))
	require.Equal(t, http.StatusServiceUnavailable, rec.Code)
	require.Contains(t, rec.Body.String(), "waiting for the broker")
	require.Contains(t, rec.Body.String(), "2 failed attempts; last: dial tcp 127.0.0.1:9092: connection refused")

	w.Done()
	rep = h.Check(context.Background())
	require.True(t, rep.Ready, rep.String())
}
