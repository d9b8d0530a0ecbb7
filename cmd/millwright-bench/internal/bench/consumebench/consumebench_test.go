package consumebench

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	c := Config{}
	c.setDefaults()
	require.ErrorContains(t, c.Validate(), "Config.Brokers and Config.DB are required")
	c = Config{Keys: -1, Delays: []time.Duration{-time.Millisecond}, FailFor: -2}
	c.setDefaults()
	err := c.Validate()
	require.ErrorContains(t, err, "--keys -1")
	require.ErrorContains(t, err, "delay -1ms is negative")
	require.ErrorContains(t, err, "--fail-for")
}

func TestConfigValidateKind(t *testing.T) {
	t.Parallel()
	c := Config{Kind: KindAMQP}
	c.setDefaults()
	require.ErrorContains(t, c.Validate(), "Config.AMQPURL and Config.DB are required")
	c = Config{Kind: KindNATS}
	c.setDefaults()
	require.ErrorContains(t, c.Validate(), "Config.NATSURL and Config.DB are required")
	c = Config{Kind: "nsq"}
	c.setDefaults()
	require.ErrorContains(t, c.Validate(), `--kind "nsq": want kafka, amqp or nats`)
}

func TestMessagesScale(t *testing.T) {
	t.Parallel()
	c := Config{Scale: 0.5}
	require.Equal(t, 10000, c.messages(0))
	require.Equal(t, 4000, c.messages(5*time.Millisecond))
	require.Equal(t, 3000, c.messages(50*time.Millisecond))
	require.Equal(t, 100, Config{Scale: 0.001}.messages(0), "at least 100")
}

// The table prints each verdict, and the counters that must be 0 loudly
// when they are not.
func TestWriteTableVerdicts(t *testing.T) {
	t.Parallel()
	rep := Report{Partitions: 8, Keys: 10000, KeyParallelism: 16, MaxConns: 80, Rows: []Row{
		{Scenario: "throughput", Consumer: ConsumerWatermill, DelayMS: 50, Messages: 10, Rate: 100},
		{Scenario: "throughput", Consumer: ConsumerKeyed, DelayMS: 50, Messages: 10, Rate: 700, Ratio: 7, Target: TargetSlowHandler, Reorders: 1},
	}}
	var b bytes.Buffer
	require.NoError(t, rep.WriteTable(&b))
	require.Contains(t, b.String(), "throughput at 50 ms: 7.00x, target >= 8.00x: NOT met")
	require.Contains(t, b.String(), "1 reorders, 0 commits past unfinished messages: MUST BE 0")
}

func TestTallyCountsReorders(t *testing.T) {
	t.Parallel()
	tl := newTally(4)
	tl.finish(ref{"a", 0}, "")
	tl.finish(ref{"a", 2}, "") // skipped seq 1
	tl.finish(ref{"b", 0}, "b")
	tl.finish(ref{"a", 2}, "") // a redelivery: ignored
	tl.finish(ref{"a", 1}, "")
	require.Equal(t, 2, tl.reorders, "a:2 before a:1, then a:1 after a:2")
	require.Equal(t, 4, tl.count)
	require.Equal(t, 3, tl.others)
	select {
	case <-tl.all:
	default:
		t.Fatal("all four finished")
	}
}

func TestSteadyRateLeavesOutStartAndTail(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(0, 0)
	var times []time.Time
	times = append(times, t0) // the first message, before a long start
	for i := 0; i < 100; i++ {
		times = append(times, t0.Add(10*time.Second+time.Duration(i)*10*time.Millisecond)) // 100 msg/s
	}
	require.InDelta(t, 100, steadyRate(times), 1)
	require.Zero(t, steadyRate(times[:1]))
}
