-- saga.Cleaner deletes completed and compensated sagas (their steps go with
-- them, ON DELETE CASCADE) some time after they finished; this index finds
-- them oldest first without reading running ones.
CREATE INDEX millwright_saga_instances_finished_idx
    ON millwright_saga_instances (updated_at)
    WHERE state IN ('completed', 'compensated');
