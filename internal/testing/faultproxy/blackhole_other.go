//go:build !linux

package faultproxy

import (
	"errors"
	"fmt"
	"runtime"
)

// Blackhole needs Linux's socket filters; elsewhere it returns an error
// wrapping errors.ErrUnsupported, for the test to skip.
func (p *Proxy) Blackhole() (int, error) {
	return 0, fmt.Errorf("faultproxy: Blackhole needs Linux socket filters, not %s: %w", runtime.GOOS, errors.ErrUnsupported)
}
