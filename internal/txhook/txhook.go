// Package txhook lets millwright's own packages pass a statement queue or
// an internal transaction where a postgres.Tx is taken (saga's staged
// writes go through outbox.Add so), without a public way to build one:
// package postgres sets the hooks at init, and storage calls them.
package txhook

// Wrap returns a postgres.Tx (as any) holding q, an internal
// storage.Querier; Unwrap returns the querier a postgres.Tx holds, or nil.
var (
	Wrap   func(q any) any
	Unwrap func(tx any) any
)
