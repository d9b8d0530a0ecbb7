package park

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/retry"
)

// Rounds back off: the park delay (Delay(1)) is followed by Delay(2),
// Delay(3)...; the budget counts rounds; MaxElapsedTime cuts the last
// delay to the budget's end.
func TestNextDelayBacksOff(t *testing.T) {
	t.Parallel()
	p := &Parker{cfg: Config{Retry: retry.Policy{InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Hour, MaxAttempts: 3, Jitter: retry.JitterNone}}}
	p.cfg.setDefaults()
	d, ok := p.nextDelay(1, 0, time.Second)
	require.True(t, ok)
	require.Equal(t, 2*time.Second, d)
	d, ok = p.nextDelay(2, 0, d)
	require.True(t, ok)
	require.Equal(t, 4*time.Second, d)
	_, ok = p.nextDelay(3, 0, d)
	require.False(t, ok, "three rounds spent")

	p.cfg.Retry.MaxAttempts, p.cfg.Retry.MaxElapsedTime = -1, 10*time.Second
	d, ok = p.nextDelay(5, 9*time.Second, 0)
	require.True(t, ok)
	require.Equal(t, time.Second, d, "cut to the budget's end")
	_, ok = p.nextDelay(6, 10*time.Second, 0)
	require.False(t, ok)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Retry: retry.Policy{MaxAttempts: -1}}, "no limit"},
		{Config{OnDeadLetter: "drop"}, `unknown Config.OnDeadLetter "drop"`},
		{Config{PollInterval: time.Millisecond}, "PollInterval"},
		{Config{Lease: time.Millisecond}, "Lease"},
		{Config{Concurrency: -1}, "Concurrency"},
	} {
		c.cfg.setDefaults()
		require.ErrorContains(t, c.cfg.Validate(), c.want)
	}
	var ok Config
	ok.setDefaults()
	require.NoError(t, ok.Validate())
	require.Equal(t, DefaultPolicy, ok.Retry)
	require.Equal(t, Hold, ok.OnDeadLetter)
}
