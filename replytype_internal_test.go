package millwright

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/saga"
)

// A participant answers with the step's default reply types, forward and
// compensating, success and refusal.
func TestReplyTypeOfCommand(t *testing.T) {
	t.Parallel()
	cmd := func(phase string) *message.Message {
		m := message.NewMessage("1", nil)
		m.Metadata.Set(metadata.SagaStep, "charge")
		m.Metadata.Set(metadata.SagaPhase, phase)
		return m
	}
	require.Equal(t, "charge.succeeded", replyType(cmd(saga.PhaseForward), true))
	require.Equal(t, "charge.failed", replyType(cmd(saga.PhaseForward), false))
	require.Equal(t, "charge.compensated", replyType(cmd(saga.PhaseCompensation), true))
	require.Equal(t, "charge.compensation_failed", replyType(cmd(saga.PhaseCompensation), false))
}
