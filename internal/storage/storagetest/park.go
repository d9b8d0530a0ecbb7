package storagetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/storage"
)

func init() { Register("park", exercisePark) }

// exercisePark checks the parked keys' operations.
func exercisePark(t *testing.T, setup func(t *testing.T) Setup) {
	for _, c := range []struct {
		name string
		f    func(*testing.T, Setup)
	}{
		{"ParkBehindOnlyWhenParked", parkBehindOnlyWhenParked},
		{"ClaimSkipsLockedHeldAndNotDue", parkClaimSkipsLockedHeldAndNotDue},
		{"CompleteAdvancesThenReleases", parkCompleteAdvancesThenReleases},
		{"StaleClaimWritesNothing", parkStaleClaimWritesNothing},
		{"DeadLetterHoldsOrContinues", parkDeadLetterHoldsOrContinues},
		{"ReplayReplacesHeldHeadAndResolves", parkReplayReplacesHeldHeadAndResolves},
		{"ReplayWaitsForRunningHead", parkReplayWaitsForRunningHead},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.f(t, setup(t))
		})
	}
}

func pm(uuid, key string) storage.ParkedMessage {
	return storage.ParkedMessage{Handler: "h", Key: key, MessageUUID: uuid, Topic: "orders", Payload: []byte{0, 'x', 0xff}, Metadata: storage.EncodeParkedMetadata(map[string]string{"k": "v'q", "b\xff": "\x00"})}
}

func pf(due time.Duration) storage.ParkFailure {
	return storage.ParkFailure{DueIn: due, Attempts: 2, PrevDelay: due, FirstFailure: dlAt, LastFailure: dlAt.Add(time.Second), LastError: "boom"}
}

func claim(t *testing.T, p storage.Pool) []storage.ParkedClaim {
	t.Helper()
	cs, err := storage.ClaimParked(context.Background(), p, []string{"h"}, 10, time.Minute)
	require.NoError(t, err)
	return cs
}

func parkBehindOnlyWhenParked(t *testing.T, st Setup) {
	ctx, p := context.Background(), st.Pool
	parked, err := storage.ParkBehind(ctx, p, pm("m1", "k"))
	require.NoError(t, err)
	require.False(t, parked, "a key not parked parks nothing")
	head, err := storage.ParkHead(ctx, p, pm("m1", "k"), pf(0))
	require.NoError(t, err)
	require.True(t, head)
	head, err = storage.ParkHead(ctx, p, pm("m0", "k"), pf(0))
	require.NoError(t, err)
	require.False(t, head, "a key parked meanwhile takes the message behind")
	for _, u := range []string{"m2", "m2"} { // a redelivery is parked once
		parked, err = storage.ParkBehind(ctx, p, pm(u, "k"))
		require.NoError(t, err)
		require.True(t, parked)
	}
	ms, err := storage.ListParkedMessages(ctx, p, "h", "k")
	require.NoError(t, err)
	require.Len(t, ms, 3)
	require.Equal(t, []string{"m1", "m0", "m2"}, []string{ms[0].MessageUUID, ms[1].MessageUUID, ms[2].MessageUUID})
	require.Equal(t, []byte{0, 'x', 0xff}, ms[0].Payload)
	md, err := storage.DecodeParkedMetadata(ms[0].Metadata)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"k": "v'q", "b\xff": "\x00"}, md, "metadata byte for byte")
	// Keys are bytes: two keys that differ only in bytes that are not
	// UTF-8 are two lanes, and a keyless lane is no real key's.
	for _, key := range []string{"\x0a\xff\x01", "\x0a\xfe\x01", storage.ParkLane("m9", true), storage.ParkLane("m9", false)} {
		head, err := storage.ParkHead(ctx, p, pm("u"+key, key), pf(time.Hour))
		require.NoError(t, err)
		require.True(t, head, "key %x is its own lane", key)
	}
	ks, err := storage.ListParked(ctx, p, "h", "\x0a\xfe\x01", 0)
	require.NoError(t, err)
	require.Len(t, ks, 1)
	require.Equal(t, "\x0a\xfe\x01", ks[0].Key)
}

func parkClaimSkipsLockedHeldAndNotDue(t *testing.T, st Setup) {
	ctx, p := context.Background(), st.Pool
	_, err := storage.ParkHead(ctx, p, pm("d1", "due"), pf(0))
	require.NoError(t, err)
	_, err = storage.ParkHead(ctx, p, pm("l1", "later"), pf(time.Hour))
	require.NoError(t, err)
	_, err = storage.ParkDead(ctx, p, pm("x1", "held"), dlRow("x1", "orders", "boom", dlAt.Add(time.Second)), true, nil)
	require.NoError(t, err)
	other, err := storage.ClaimParked(ctx, p, []string{"other"}, 10, time.Minute)
	require.NoError(t, err)
	require.Empty(t, other, "only the given handlers' keys")

	// A claim in flight (a retrier's transaction) hides its keys.
	tx, err := p.Begin(ctx, storage.TxOptions{})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	inTx, err := storage.ClaimParked(ctx, tx, []string{"h"}, 10, time.Minute)
	require.NoError(t, err)
	require.Len(t, inTx, 1)
	require.Empty(t, claim(t, p), "locked keys are skipped")
	require.NoError(t, tx.Rollback(ctx))

	cs := claim(t, p)
	require.Len(t, cs, 1, "not the held key, nor the one not due")
	c := cs[0]
	require.Equal(t, "due", c.Key)
	require.Equal(t, 2, c.Attempts)
	require.Equal(t, dlAt, c.FirstFailure.Time.UTC())
	require.NotNil(t, c.Head)
	require.Equal(t, "d1", c.Head.MessageUUID)
	require.Empty(t, claim(t, p), "a claimed key is leased")
}

func parkCompleteAdvancesThenReleases(t *testing.T, st Setup) {
	ctx, p := context.Background(), st.Pool
	_, err := storage.ParkHead(ctx, p, pm("c1", "k"), pf(0))
	require.NoError(t, err)
	_, err = storage.ParkBehind(ctx, p, pm("c2", "k"))
	require.NoError(t, err)
	c := claim(t, p)[0]
	require.NoError(t, storage.CompleteParked(ctx, p, "h", "k", c.Claim, c.Head.ID, nil))
	c = claim(t, p)[0]
	require.Equal(t, "c2", c.Head.MessageUUID, "the next message is due at once")
	require.Zero(t, c.Attempts, "with a fresh budget")
	require.False(t, c.FirstFailure.Valid)
	require.NoError(t, storage.CompleteParked(ctx, p, "h", "k", c.Claim, c.Head.ID, nil))
	ks, err := storage.ListParked(ctx, p, "", "", 0)
	require.NoError(t, err)
	require.Empty(t, ks, "the last message done releases the key")
	parked, err := storage.ParkBehind(ctx, p, pm("c3", "k"))
	require.NoError(t, err)
	require.False(t, parked)
}

func parkStaleClaimWritesNothing(t *testing.T, st Setup) {
	ctx, p := context.Background(), st.Pool
	_, err := storage.ParkHead(ctx, p, pm("s1", "k"), pf(0))
	require.NoError(t, err)
	c := claim(t, p)[0]
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_parked_keys SET due_at = now()`))
	require.NoError(t, err)
	newer := claim(t, p)[0] // the lease passed: another retrier
	require.ErrorIs(t, storage.CompleteParked(ctx, p, "h", "k", c.Claim, c.Head.ID, nil), storage.ErrParkedClaimLost)
	require.ErrorIs(t, storage.RescheduleParked(ctx, p, "h", "k", c.Claim, pf(0)), storage.ErrParkedClaimLost)
	f := pf(time.Hour)
	f.Attempts, f.Rounds = 5, 1
	require.NoError(t, storage.RescheduleParked(ctx, p, "h", "k", newer.Claim, f))
	ks, err := storage.ListParked(ctx, p, "h", "", 0)
	require.NoError(t, err)
	require.Len(t, ks, 1)
	require.Equal(t, 5, ks[0].Attempts)
	require.Equal(t, 1, ks[0].Rounds)
	require.EqualValues(t, 1, ks[0].Messages)
	require.True(t, ks[0].DueAt.After(time.Now().Add(30*time.Minute)))
}

func parkDeadLetterHoldsOrContinues(t *testing.T, st Setup) {
	ctx, p := context.Background(), st.Pool
	for _, key := range []string{"hold", "cont"} {
		_, err := storage.ParkHead(ctx, p, pm(key+"1", key), pf(0))
		require.NoError(t, err)
		_, err = storage.ParkBehind(ctx, p, pm(key+"2", key))
		require.NoError(t, err)
	}
	for _, c := range claim(t, p) {
		dl := dlRow(c.Head.MessageUUID, "orders", "boom", dlAt.Add(time.Minute))
		id, err := storage.DeadLetterParked(ctx, p, c.Claim, c.Head.ID, 3, dl, c.Key, c.Key == "hold", nil)
		require.NoError(t, err)
		require.NotZero(t, id)
	}
	ks, err := storage.ListParked(ctx, p, "h", "", 0)
	require.NoError(t, err)
	require.Len(t, ks, 2)
	require.Equal(t, "hold", ks[0].Key, "held keys first")
	require.True(t, ks[0].Held)
	require.True(t, ks[0].DeadLetterID.Valid)
	require.EqualValues(t, 2, ks[0].Messages, "the held head stays")
	require.False(t, ks[1].Held)
	require.EqualValues(t, 1, ks[1].Messages, "continue drops the head")
	cs := claim(t, p)
	require.Len(t, cs, 1, "the held key is not claimed")
	require.Equal(t, "cont2", cs[0].Head.MessageUUID)

	require.ErrorIs(t, storage.ReleaseParked(ctx, p, "h", "cont", false), storage.ErrParkedClaimLost, "release needs a held key")
	require.NoError(t, storage.ReleaseParked(ctx, p, "h", "hold", false))
	ms, err := storage.ListParkedMessages(ctx, p, "h", "hold")
	require.NoError(t, err)
	require.Len(t, ms, 1)
	require.Equal(t, "hold2", ms[0].MessageUUID)
	require.NoError(t, storage.RetryParked(ctx, p, "h", "hold"))
	require.ErrorIs(t, storage.RetryParked(ctx, p, "h", "none"), storage.ErrParkedClaimLost)
	d, err := storage.ParkedDepths(ctx, p)
	require.NoError(t, err)
	require.Equal(t, storage.ParkedDepth{Keys: 2, Messages: 2, Held: 0}, d["h"])
	one, err := storage.ListParked(ctx, p, "", "cont", 0)
	require.NoError(t, err)
	require.Len(t, one, 1)
	require.Equal(t, "cont", one[0].Key)
}

// A replay of a held head's dead letter takes the head's place and lifts
// the hold; the head applied, CompleteParked hands its dead letter to the
// resolver in its transaction, which ResolveDeadLetter moves to resolved.
func parkReplayReplacesHeldHeadAndResolves(t *testing.T, st Setup) {
	ctx, p := context.Background(), st.Pool
	_, err := storage.ParkHead(ctx, p, pm("r1", "k"), pf(0))
	require.NoError(t, err)
	_, err = storage.ParkBehind(ctx, p, pm("r2", "k"))
	require.NoError(t, err)
	c := claim(t, p)[0]
	id, err := storage.DeadLetterParked(ctx, p, c.Claim, c.Head.ID, 1, dlRow("r1", "orders", "boom", dlAt.Add(time.Minute)), c.Key, true, nil)
	require.NoError(t, err)
	require.NotZero(t, id)

	none, err := storage.ReplaceParked(ctx, p, "h", id+1000, pm("other", "k"), nil)
	require.NoError(t, err)
	require.False(t, none.Replaced, "no parked message of that dead letter or UUID")
	replay := pm("r1", "k")
	replay.Payload = []byte("fixed\xff")
	var merged []byte
	r, err := storage.ReplaceParked(ctx, p, "h", id, replay, func(parked []byte) []byte {
		merged = parked
		return storage.EncodeParkedMetadata(map[string]string{"m": "\x00\xff"})
	})
	require.NoError(t, err)
	require.Equal(t, storage.ReplacedParked{Replaced: true, Key: "k", Released: true}, r)
	require.Equal(t, pm("r1", "k").Metadata, merged, "merge sees the parked metadata")
	ks, err := storage.ListParked(ctx, p, "h", "k", 0)
	require.NoError(t, err)
	require.False(t, ks[0].Held, "the hold is lifted")

	cs := claim(t, p)
	require.Len(t, cs, 1)
	head := cs[0].Head
	require.Equal(t, []byte("fixed\xff"), head.Payload)
	md, err := storage.DecodeParkedMetadata(head.Metadata)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"m": "\x00\xff"}, md)
	require.Equal(t, id, head.DeadLetterID)
	var resolved int64
	require.NoError(t, storage.CompleteParked(ctx, p, "h", "k", cs[0].Claim, head.ID, func(ctx context.Context, tx storage.Tx, dl int64) error {
		resolved = dl
		ok, err := storage.ResolveDeadLetter(ctx, tx, dl, "test")
		require.True(t, ok)
		return err
	}))
	require.Equal(t, id, resolved)
	row, err := storage.GetDeadLetter(ctx, p, id)
	require.NoError(t, err)
	require.Equal(t, "resolved", row.State)
	ok, err := storage.ResolveDeadLetter(ctx, p, id, "test")
	require.NoError(t, err)
	require.False(t, ok, "resolved once")
}

// A replay of a head that a retrier's round is running (claimed, its
// lease holding) writes nothing and fails with ErrParkedHeadRunning; once
// the round ended (rescheduled, held) or its lease passed (the retrier
// died), the replay replaces the head. A message behind the head is
// replaced while the round runs.
func parkReplayWaitsForRunningHead(t *testing.T, st Setup) {
	ctx, p := context.Background(), st.Pool
	_, err := storage.ParkHead(ctx, p, pm("w1", "k"), pf(0))
	require.NoError(t, err)
	_, err = storage.ParkBehind(ctx, p, pm("w2", "k"))
	require.NoError(t, err)
	c := claim(t, p)[0]
	id, err := storage.DeadLetterParked(ctx, p, c.Claim, c.Head.ID, 1, dlRow("w1", "orders", "boom", dlAt.Add(time.Minute)), c.Key, true, nil)
	require.NoError(t, err)
	require.NoError(t, storage.RetryParked(ctx, p, "h", "k"))

	payload := func() []byte {
		ms, err := storage.ListParkedMessages(ctx, p, "h", "k")
		require.NoError(t, err)
		return ms[0].Payload
	}
	replay := func(payload string) (storage.ReplacedParked, error) {
		m := pm("w1", "k")
		m.Payload = []byte(payload)
		return storage.ReplaceParked(ctx, p, "h", id, m, nil)
	}
	running := func() storage.ParkedClaim {
		cs := claim(t, p)
		require.Len(t, cs, 1)
		return cs[0]
	}
	c = running()
	require.NoError(t, storage.ExtendParked(ctx, p, "h", "k", c.Claim, time.Minute))
	// An operator's retry of the running key keeps its lease: not due,
	// so neither claimed beside the round nor replaced under it.
	require.NoError(t, storage.RetryParked(ctx, p, "h", "k"))
	require.Empty(t, claim(t, p), "a running key's retry leaves it to its round")
	r, err := replay("one")
	require.True(t, errors.Is(err, storage.ErrParkedHeadRunning), "a running head is not replaced: %v", err)
	require.ErrorContains(t, err, "parked key ")
	require.False(t, r.Replaced)
	require.Equal(t, pm("w1", "k").Payload, payload(), "nothing written")
	behind := pm("w2", "k")
	behind.Payload = []byte("two")
	r, err = storage.ReplaceParked(ctx, p, "h", 0, behind, nil)
	require.NoError(t, err)
	require.True(t, r.Replaced, "a message behind the running head is replaced")

	// The round failed: rescheduled, the round is over.
	f := pf(0)
	require.NoError(t, storage.RescheduleParked(ctx, p, "h", "k", c.Claim, f))
	r, err = replay("after reschedule")
	require.NoError(t, err)
	require.True(t, r.Replaced)
	require.Equal(t, []byte("after reschedule"), payload())

	// The round was set aside (held).
	c = running()
	_, err = replay("blocked")
	require.True(t, errors.Is(err, storage.ErrParkedHeadRunning), "%v", err)
	require.NoError(t, storage.HoldParked(ctx, p, "h", "k", c.Claim, "set aside"))
	r, err = replay("after hold")
	require.NoError(t, err)
	require.Equal(t, storage.ReplacedParked{Replaced: true, Key: "k", Released: true}, r)

	// The retrier died: its lease passed.
	running()
	_, err = replay("blocked")
	require.True(t, errors.Is(err, storage.ErrParkedHeadRunning), "%v", err)
	_, err = p.Exec(ctx, storage.S(`UPDATE millwright_parked_keys SET due_at = now() - interval '1 second'`))
	require.NoError(t, err)
	r, err = replay("after lease")
	require.NoError(t, err)
	require.True(t, r.Replaced)
	require.Equal(t, []byte("after lease"), payload())
}
