package outboxbench

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
)

// Odd rounds run the variants the other way round: each bare loop and
// relay pair, and N and N-1 relays; every variant runs once a round.
func TestRoundOrderReversesOddRounds(t *testing.T) {
	require.Equal(t, []int{0, 1, 2, 3, 4, 5}, roundOrder(6, 0))
	require.Equal(t, []int{5, 4, 3, 2, 1, 0}, roundOrder(6, 1))
	require.Equal(t, []int{0, 1, 2, 3, 4, 5}, roundOrder(6, 2))
	require.Equal(t, []int{2, 1, 0}, roundOrder(3, 1))
}

// The ratio is the median of the rounds' own ratios: a round where both
// ran slow counts as the ratio it shows, not as a slow relay beside a fast
// bare loop of another round.
func TestPairedRatioIsTheMedianOfEachRoundsRatio(t *testing.T) {
	relay := []float64{50, 100, 60}
	bare := []float64{55, 105, 100}
	// Medians of the runs: 60 / 100 = 0.60; the rounds: 0.91, 0.95, 0.60.
	require.InDelta(t, 0.909, pairedRatio(relay, bare), 0.001)
	require.InDelta(t, 0.60, median(relay)/median(bare), 0.001)
	require.Zero(t, pairedRatio(nil, nil))
}

// A drain without relay counts is a configuration error: Run refuses it
// before any section runs (it opens no broker: Config.Open is nil here),
// instead of skipping the drain on every broker.
func TestDrainWithoutRelayCountsIsAnError(t *testing.T) {
	err := Run(t.Context(), Config{Sections: []string{SectionDrain}, Kinds: []transport.Kind{transport.GoChannel}})
	require.EqualError(t, err, "drain: no relay counts (Config.Relays)")
}
