-- Schema 3, the last schema before versioned migrations, as PostgreSQL
-- writes it. Every statement is IF NOT EXISTS: a database made before
-- versions already has these tables, and gets only what it lacks.
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    seq BIGINT NOT NULL,
    state TEXT NOT NULL,
    body TEXT NOT NULL,
    last_activity_at TEXT,
    network TEXT,
    lifecycle TEXT,
    tenant TEXT
);
CREATE TABLE IF NOT EXISTS operations (
    id TEXT PRIMARY KEY,
    seq BIGINT NOT NULL,
    sandbox_id TEXT,
    idempotency_key TEXT,
    body TEXT NOT NULL,
    tenant TEXT NOT NULL DEFAULT 'default'
);
CREATE INDEX IF NOT EXISTS operations_by_sandbox ON operations (sandbox_id);
CREATE UNIQUE INDEX IF NOT EXISTS operations_by_tenant_key ON operations (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS commands (
    id TEXT PRIMARY KEY,
    seq BIGINT NOT NULL,
    sandbox_id TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS commands_by_sandbox ON commands (sandbox_id);
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    quotas TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS command_streams (
    command_id TEXT PRIMARY KEY,
    stream BIGINT NOT NULL,
    timeout_s BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS contexts (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS contexts_by_sandbox ON contexts (sandbox_id);
CREATE TABLE IF NOT EXISTS egress_events (
    seq BIGSERIAL PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS egress_events_by_sandbox ON egress_events (sandbox_id, seq);
CREATE TABLE IF NOT EXISTS secrets (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    hosts TEXT NOT NULL,
    sealed BYTEA NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS events (
    seq BIGSERIAL PRIMARY KEY,
    tenant TEXT NOT NULL,
    sandbox_id TEXT,
    kind TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_tenant ON events (tenant, seq);
CREATE INDEX IF NOT EXISTS sandboxes_live ON sandboxes (seq) WHERE state <> 'deleted';
CREATE INDEX IF NOT EXISTS sandboxes_by_seq ON sandboxes (seq);
CREATE INDEX IF NOT EXISTS operations_by_seq ON operations (seq);
CREATE INDEX IF NOT EXISTS commands_by_seq ON commands (seq);
-- what the control plane of a cluster keeps (decision 009): the nodes with
-- their leases, and where each sandbox and operation lives
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    lease_until_ms BIGINT NOT NULL,
    report TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS placements (
    sandbox_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    sandbox TEXT NOT NULL,
    placed_at_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS placements_by_node ON placements (node_id, placed_at_ms);
CREATE INDEX IF NOT EXISTS placements_by_tenant ON placements (tenant);
CREATE TABLE IF NOT EXISTS create_keys (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    node_id TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE TABLE IF NOT EXISTS template_pulls (
    node_id TEXT NOT NULL,
    name TEXT NOT NULL,
    until_ms BIGINT NOT NULL,
    PRIMARY KEY (node_id, name)
);
CREATE TABLE IF NOT EXISTS node_feeds (
    node_id TEXT PRIMARY KEY,
    last_seq BIGINT NOT NULL,
    owner TEXT NOT NULL,
    until_ms BIGINT NOT NULL,
    lost BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS secrets_epoch (
    id BIGINT PRIMARY KEY,
    epoch BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS operation_nodes (
    operation_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    tenant TEXT NOT NULL
);
