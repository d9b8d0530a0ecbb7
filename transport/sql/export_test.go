package sql

// HorizonChecks counts the horizon monitor's finished checks (0 when it is
// disabled), so tests wait for checks instead of sleeping.
func HorizonChecks(t *Transport) int64 {
	if t.mon == nil {
		return 0
	}
	return t.mon.checks.Load()
}
