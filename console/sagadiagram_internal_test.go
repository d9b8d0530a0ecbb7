package console

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/saga"
)

// A definition with a parallel group and a waiting step, drawn for an
// instance that waits at the wait step: the group's branches share a row
// inside its frame, the wait step is a pill saying what it waits for, and
// it is marked current.
func TestLayoutSagaGroupAndWait(t *testing.T) {
	t.Parallel()
	steps, err := saga.ParseStepGraph("step reserve\tsuccess=\"r.ok\"\tfailure=\"r.failed\"\tcompensation=yes\tcompensated=\"r.undone\"\tcompensation_failed=\"r.undo_failed\"\tgroup=\"prepare\"\n" +
		"step charge\tsuccess=\"c.ok\"\tfailure=\"c.failed\"\tcompensation=yes\tcompensated=\"c.undone\"\tcompensation_failed=\"c.undo_failed\"\tgroup=\"prepare\"\n" +
		"step approval\tsuccess=\"\"\tfailure=\"\"\tcompensation=no\tkind=\"wait approved\"\n" +
		"step ship\tsuccess=\"s.ok\"\tfailure=\"s.failed\"\tcompensation=no\tkind=\"retriable\"\n")
	require.NoError(t, err)
	require.Equal(t, saga.GraphStep{Name: "approval", Kind: saga.GraphWait, WaitFor: "approved"}, steps[2])
	require.Equal(t, "prepare", steps[0].Group)
	require.True(t, steps[1].Compensation)
	require.Equal(t, saga.GraphRetriable, steps[3].Kind)

	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	hist := []saga.HistoryEntry{
		{Step: "reserve", Kind: saga.KindCommand, At: at},
		{Step: "charge", Kind: saga.KindCommand, At: at},
		{Step: "charge", Kind: saga.KindReply, At: at.Add(300 * time.Millisecond)},
		{Step: "reserve", Kind: saga.KindReply, At: at.Add(2 * time.Second)},
		{Step: "approval", Kind: saga.KindWait, Detail: "approved", At: at.Add(2 * time.Second)},
	}
	in := saga.Info{State: saga.StateRunning, Step: "approval", StepIndex: 2}
	d := layoutSaga(steps, in, hist)

	boxes := map[string]dgBox{}
	for _, b := range d.Boxes {
		key := b.Step
		if b.Step == "" {
			key = b.Label
		} else if b.Class[:4] == "undo" {
			key = "undo " + b.Step
		}
		boxes[key] = b
	}
	require.Equal(t, "step kind-command taken", boxes["reserve"].Class)
	require.Equal(t, "command · 2s", boxes["reserve"].Sub, "how long reserve's command took")
	require.Equal(t, "command · 300ms", boxes["charge"].Sub)
	require.Equal(t, boxes["reserve"].Y, boxes["charge"].Y, "the group's branches share a row")
	require.Equal(t, "step kind-wait sent current", boxes["approval"].Class)
	require.Equal(t, "waits for approved", boxes["approval"].Sub)
	require.Equal(t, dgBoxH/2, boxes["approval"].Rx, "a wait is a pill")
	require.Equal(t, "step kind-retriable", boxes["ship"].Class)
	require.Equal(t, "undo", boxes["undo reserve"].Class, "no compensation was sent")
	require.Equal(t, []dgGroup{{X: boxes["reserve"].X - 8, Y: boxes["reserve"].Y - 16, W: 2*dgBoxW + dgGapX + 16, H: dgBoxH + 24, Name: "prepare"}}, d.Groups)
	require.Greater(t, boxes["ship"].Y, boxes["approval"].Y)

	g := layoutGantt(hist, at.Add(3*time.Second))
	var classes []string
	for _, b := range g.Bars {
		classes = append(classes, b.Class)
	}
	require.Equal(t, []string{"gt-forward", "gt-forward", "gt-forward gt-open"}, classes, "reserve, charge, and the wait still open")
	require.Equal(t, "3s", g.Total)
}
