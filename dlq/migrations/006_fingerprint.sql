-- The cause of a failure (issue 43): dead letters grouped by error_type put
-- every errors.New under *errors.errorString, and split one cause whose
-- message carries an id or a count. fingerprint is 16 hex digits of the
-- SHA-256 of the handler, the error type and the error message normalised
-- (numbers, UUIDs, hex ids, durations and quoted values replaced:
-- dlq.NormalizeError), computed by the one writer, dlq.RecordTx, and
-- grouped by the console's first page and `millwright dlq groups`.
--
-- Rows recorded before this migration keep NULL: their fingerprint is
-- computed when they are read (dlq.Causes groups them by handler, error
-- type and message in SQL, then by the fingerprint of each in Go). A
-- backfill here would have to copy the normaliser into SQL, whose regular
-- expressions differ from Go's in details (word boundaries, Unicode), so
-- an old row and a new one of the same cause could land in two groups;
-- and it would rewrite every row of a large table inside the migration's
-- transaction. Old rows leave with retention.
--
-- The column stays nullable for the same reason as migration 005's: an
-- older millwright still recording during a rollout writes NULL, and its
-- rows are fingerprinted on read like the old ones.
ALTER TABLE millwright_dead_letters ADD COLUMN fingerprint TEXT;

CREATE INDEX millwright_dead_letters_fingerprint_idx ON millwright_dead_letters (fingerprint, id);
