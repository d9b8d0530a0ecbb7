package idempotency_test

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/idempotency/idempotencytest"
	"github.com/millwright/millwright/metadata"
)

// FuzzEventID extracts event ids from hostile metadata: no panic; an
// accepted id is what was sent and is storable (valid UTF-8, no NUL, at
// most MaxEventIDBytes); a refused one is a permanent error naming where
// the id came from, quoting at most a bounded prefix of it.
func FuzzEventID(f *testing.F) {
	for _, s := range []string{"evt-1", "", `'); DROP TABLE millwright_processed_events; --`, "evt\x00-1", "\xff\xfe",
		strings.Repeat("é", idempotency.MaxEventIDBytes/2), strings.Repeat("x", idempotency.MaxEventIDBytes+1), "$1"} {
		f.Add(s, "uuid-1", true)
	}
	withKeyFunc, err := idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{
		Consumer: "billing", KeyFunc: idempotency.KeyFromUUID, Registerer: prometheus.NewRegistry()})
	if err != nil {
		f.Fatal(err)
	}
	plain, err := idempotency.NewMiddleware(idempotency.NewMemoryStore(), idempotency.Config{
		Consumer: "billing", Registerer: prometheus.NewRegistry()})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, id, uuid string, keyFunc bool) {
		msg := message.NewMessage(uuid, nil)
		if id != "" {
			msg.Metadata.Set(metadata.EventID, id)
		}
		m := plain
		if keyFunc {
			m = withKeyFunc
		}
		got, err := m.EventID(msg)
		want := id
		if want == "" && keyFunc {
			want = uuid
		}
		if err != nil {
			checkEventIDRefusal(t, err, want, uuid)
			return
		}
		if got != want {
			t.Fatalf("EventID = %q, want %q", got, want)
		}
		if len(got) > idempotency.MaxEventIDBytes || !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 {
			t.Fatalf("accepted an id no store can keep: %q", got)
		}
	})
}

// checkEventIDRefusal: a refused id (want, "" when there was none) is a
// permanent ErrNoEventID, an ErrInvalidEventID naming where the id came
// from when there was one, quoting at most a bounded prefix of it.
func checkEventIDRefusal(t *testing.T, err error, want, uuid string) {
	if !errors.Is(err, idempotency.ErrNoEventID) || !failure.IsPermanent(err) {
		t.Fatalf("error is not a permanent ErrNoEventID: %v", err)
	}
	if want != "" && !errors.Is(err, idempotency.ErrInvalidEventID) {
		t.Fatalf("id %q refused without ErrInvalidEventID: %v", want, err)
	}
	if want != "" && !strings.Contains(err.Error(), metadata.EventID) && !strings.Contains(err.Error(), "KeyFunc") {
		t.Fatalf("error does not say where the id came from: %v", err)
	}
	if len(err.Error()) > 600+len(uuid) {
		t.Fatalf("error of %d bytes echoes the id unbounded", len(err.Error()))
	}
}

// TestOversizedEventIDFailsPermanently: Postgres cannot index an id of a
// few kilobytes ("index row size exceeds maximum"), which used to fail on
// every redelivery; the middleware now refuses it at once, permanently,
// without running the handler, and accepts one of MaxEventIDBytes.
func TestOversizedEventIDFailsPermanently(t *testing.T) {
	t.Parallel()
	b := setupPG(t)
	m, _ := newMiddleware(t, b.store, idempotency.Config{Consumer: "billing"})
	var calls atomic.Int64
	var rnd [2048]byte
	_, _ = rand.Read(rnd[:])
	_, err := m.Middleware(countingHandler(&calls))(idempotencytest.NewMessage(hex.EncodeToString(rnd[:]), nil))
	require.ErrorIs(t, err, idempotency.ErrInvalidEventID)
	require.True(t, failure.IsPermanent(err))
	require.Contains(t, err.Error(), "4096 bytes long: want at most 1024")
	require.Less(t, len(err.Error()), 400, "the id is not echoed whole")
	require.Zero(t, calls.Load())

	_, err = m.Middleware(countingHandler(&calls))(idempotencytest.NewMessage(hex.EncodeToString(rnd[:idempotency.MaxEventIDBytes/2]), nil))
	require.NoError(t, err, "an id of MaxEventIDBytes random bytes is stored")
	require.EqualValues(t, 1, calls.Load())
}
