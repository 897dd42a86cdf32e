-- volumes (issue 37, decision 031): one row per live volume of a tenant
-- (deleted by removing the row, before its subvolume goes), its record
-- as JSON; names are unique within a tenant.
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS volumes_by_name ON volumes (tenant, name);
-- a volume's snapshots, each written once its subvolume is there
CREATE TABLE IF NOT EXISTS volume_snapshots (
    volume_id TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (volume_id, name)
);
