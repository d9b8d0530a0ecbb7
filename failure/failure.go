package failure

import "errors"

// PermanentError marks an error that retrying cannot fix. Create it with
// Permanent; test for it with IsPermanent or errors.As.
type PermanentError struct {
	// Err is the error that stopped the work.
	Err error
}

// Permanent wraps err so that retrying stops at once (the retry
// middleware, retry.Do, transport.Open's wait for a broker) and the
// dead-letter middleware records the message without wasting attempts.
// Permanent(nil) returns nil, so it can wrap a call's result directly:
// `return failure.Permanent(json.Unmarshal(...))`. An error already
// permanent is returned as it is.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	if IsPermanent(err) {
		return err
	}
	return &PermanentError{Err: err}
}

// Error returns the wrapped error's text unchanged, so logs and dead letters
// show the cause rather than the wrapper.
func (e *PermanentError) Error() string {
	if e.Err == nil {
		return "permanent error"
	}
	return e.Err.Error()
}

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// IsPermanent reports whether err or any error it wraps was marked with
// Permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}
