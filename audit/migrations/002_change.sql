-- The change an action made, for the actions that change a message
-- (the console's edit and replay): a line diff of the payload and the
-- metadata, secrets masked. NULL for the others.
ALTER TABLE millwright_audit ADD COLUMN change TEXT;
