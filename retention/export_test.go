package retention

import "github.com/millwright/millwright/internal/storage"

// Table and New let the external tests build a cleaner of a table of
// their own.
type Table = table

func New(db storage.Pool, t Table, cfg Config) (*Cleaner, error) { return newOn(db, t, cfg) }
