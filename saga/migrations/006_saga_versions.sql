-- Versioned saga definitions: an instance runs on the definition version
-- it started on, to its end (or until an operator migrates it), and the
-- fingerprint of that version's step graph is stored with it, so an
-- orchestrator can refuse a definition whose steps changed under an
-- unchanged version while instances of it are still running.
--
-- (The existing version column is the row's optimistic-concurrency
-- counter, not the definition's version.)
ALTER TABLE millwright_saga_instances
    -- Instances from before versions run on version 1.
    ADD COLUMN def_version INT NOT NULL DEFAULT 1,
    -- Fingerprint of the step graph the instance started on (or was
    -- migrated to); NULL for instances from before versions (not checked).
    ADD COLUMN def_fingerprint TEXT;

-- Every (type, version, fingerprint) an orchestrator has run, with the
-- step graph's canonical text: when a definition changed under an
-- unchanged version, the orchestrator compares the running instances'
-- graph with its own and names the change.
CREATE TABLE millwright_saga_definitions (
    type          TEXT        NOT NULL,
    version       INT         NOT NULL,
    fingerprint   TEXT        NOT NULL,
    graph         TEXT        NOT NULL,
    registered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (type, version, fingerprint)
);
