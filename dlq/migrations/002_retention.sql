-- dlq.Cleaner deletes dead letters older than its retention, oldest first.
CREATE INDEX millwright_dead_letters_created_idx
    ON millwright_dead_letters (created_at);
