-- which node of a cluster holds each tenant's volume (issue 37, decision
-- 031), kept by the control plane: a row is claimed before the node is
-- asked to make the volume (so two replicas never make one name on two
-- nodes) and removed once its node deleted it; `moving_until_ms` is the
-- lease of a move in progress (0: none), under which writes and mounts
-- are refused.
CREATE TABLE IF NOT EXISTS volume_nodes (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    node_id TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    moving_until_ms BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, name)
);
CREATE INDEX IF NOT EXISTS volume_nodes_by_node ON volume_nodes (node_id);
