//go:build !linux

package faultproxy

import (
	"errors"
	"fmt"
	"runtime"
)

// Vanish needs Linux's socket filters; elsewhere it returns an error
// wrapping errors.ErrUnsupported, for the test to skip.
func (p *Proxy) Vanish() (int, error) {
	return 0, fmt.Errorf("faultproxy: Vanish needs Linux socket filters, not %s: %w", runtime.GOOS, errors.ErrUnsupported)
}
