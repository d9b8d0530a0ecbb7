// Package retry retries failing work with exponential backoff and jitter.
//
// Policy is the one backoff policy of millwright: the retry middleware and
// the outbox relay use it alike. Errors decide whether to retry: wrap an
// error with Permanent to stop at once.
package retry
