package outboxbench

import (
	"errors"
	"strings"
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

// A kind asked for whose broker cannot be opened is a row saying so, in
// the table and in --json, for the latency and drain sections: never
// silence (the latency section printed nothing for googlecloud).
func TestKindThatCannotRunIsARow(t *testing.T) {
	for _, asJSON := range []bool{false, true} {
		var out strings.Builder
		err := Run(t.Context(), Config{
			Sections: []string{SectionLatency, SectionDrain}, Relays: []int{1}, JSON: asJSON, Out: &out,
			Kinds: []transport.Kind{transport.GoogleCloud},
			Open: func(k transport.Kind) (Broker, error) {
				return Broker{}, errors.New("no Pub/Sub emulator at 127.0.0.1:1")
			},
		})
		require.NoError(t, err)
		for _, section := range []string{"latency googlecloud", "drain googlecloud"} {
			require.Contains(t, out.String(), section, "json %v:\n%s", asJSON, out.String())
		}
		require.Equal(t, 2, strings.Count(out.String(), "no Pub/Sub emulator at 127.0.0.1:1"), out.String())
		if !asJSON {
			require.Contains(t, out.String(), "every variant: not run: no Pub/Sub emulator")
		} else {
			require.Contains(t, out.String(), `"not_run":"no Pub/Sub emulator`)
		}
	}
}
