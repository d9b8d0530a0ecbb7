// Package idempotencytest holds test helpers for the idempotency package:
// the shared test suite every Store passes (Exercise), and message builders
// for testing handlers wrapped by the middleware.
//
// Test a new Store by running the suite against a fresh store per subtest:
//
//	func TestMyStore(t *testing.T) {
//		idempotencytest.Exercise(t, func(t *testing.T) idempotency.Store {
//			return newMyStore(t)
//		})
//	}
package idempotencytest
