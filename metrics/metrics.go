package metrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers c with reg and returns it, or returns the collector of
// the same type already registered under its description. Any other
// failure (a name registered with other labels or help) is returned with c.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, err
}

// Into is Register for registering several collectors in a row: it joins
// a failure into *errp and returns the collector to use.
func Into[C prometheus.Collector](reg prometheus.Registerer, c C, errp *error) C {
	c, err := Register(reg, c)
	*errp = errors.Join(*errp, err)
	return c
}
