//! A tenant's quotas, cluster-wide: what a create asks for, what the
//! tenant holds on the live nodes, the disk allowance a node is told, and
//! `GET /v1/usage` added up over the nodes. Nodes keep no quotas of their
//! own in a cluster.

use axum::response::{IntoResponse, Response};
use space_api::cluster::{DiskAllowance, TemplateSize};
use space_api::{DiskUsage, Usage};
use space_core::tenants::Caller;
use space_store::Quotas;

use crate::error::ControlError;
use crate::node_client::NodeClient;
use crate::state::{nodes, placed_sandbox, ControlPlane, Node};

/// What a create asks for, as far as placing it goes: its template, and
/// the vCPUs and memory it names (else its template's defaults).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wanted<'a> {
    pub(crate) template: &'a str,
    pub(crate) vcpus: Option<u32>,
    pub(crate) memory_mib: Option<u32>,
}

/// A tenant's quotas, cluster-wide: the sandboxes its placements hold on
/// live nodes (by their size as created) and `count` new ones of `wanted`
/// (vCPUs, MiB).
pub(crate) fn check_quotas(
    cp: &ControlPlane,
    caller: &Caller,
    quotas: &Quotas,
    nodes: &[Node],
    wanted: (u64, u64),
    count: u32,
) -> Result<(), ControlError> {
    if quotas.max_sandboxes.is_none() && quotas.max_vcpus.is_none() && quotas.max_memory_mib.is_none() {
        return Ok(());
    }
    // The placements as kept (each sandbox as its node last answered).
    let mut held = Vec::new();
    for placement in cp.store.cluster().placements(&caller.tenant)? {
        let sandbox = placed_sandbox(&placement)?;
        if nodes.iter().any(|n| n.row.id == placement.node_id && n.holds(&placement, &sandbox.id)) {
            held.push((u64::from(sandbox.vcpus), u64::from(sandbox.memory_mib)));
        }
    }
    // All but the last of several count as held when the last is checked.
    held.extend(std::iter::repeat_n(wanted, count.saturating_sub(1) as usize));
    Ok(space_core::tenants::check_held(&caller.tenant, quotas, &held, wanted)?)
}

/// For a request that may make a tenant hold more disk on `node` (a
/// create, a suspend, a template build): the tenant's disk quota and what
/// it holds on the other live nodes.
pub(crate) async fn disk_allowance(
    cp: &ControlPlane,
    caller: &Caller,
    max_disk_mib: Option<u64>,
    node: &str,
) -> Result<DiskAllowance, ControlError> {
    let Some(max_mib) = max_disk_mib else {
        return Ok(DiskAllowance::Unlimited);
    };
    let mut elsewhere_bytes = 0;
    for other in nodes(cp)?.into_iter().filter(|n| n.alive && n.row.id != node) {
        let client = NodeClient::new(cp, &other.row);
        elsewhere_bytes += client.usage(caller).await.map_err(|e| e.into_control(client.id()))?.disk.total_bytes;
    }
    Ok(DiskAllowance::Quota { max_mib, elsewhere_bytes })
}

/// The vCPUs and MiB a create asks for: what it names, else its template's
/// defaults as a live node that has the template reports them, else the
/// defaults of a template that sets none (as a node would give it).
pub(crate) fn create_size(wanted: &Wanted, nodes: &[Node]) -> (u64, u64) {
    let reported = nodes.iter().filter(|n| n.alive).find_map(|n| n.report.sizes.get(wanted.template).copied());
    let fallback = space_host::template::TemplateDefaults::default();
    let size = reported.unwrap_or(TemplateSize { vcpus: fallback.vcpus, memory_mib: fallback.memory_mib });
    (u64::from(wanted.vcpus.unwrap_or(size.vcpus)), u64::from(wanted.memory_mib.unwrap_or(size.memory_mib)))
}

/// `GET /v1/usage`: what the tenant holds on every live node, added up,
/// against its quotas (kept in PostgreSQL).
pub(crate) async fn usage(cp: &ControlPlane, caller: &Caller) -> Result<Response, ControlError> {
    let quotas = space_core::tenants::quota_limits(&cp.store.tenancy().tenant_quotas(&caller.tenant)?);
    let mut total = Usage {
        tenant: caller.tenant.clone(),
        quotas,
        sandboxes: 0,
        vcpus: 0,
        memory_mib: 0,
        disk: DiskUsage::default(),
    };
    for node in nodes(cp)?.into_iter().filter(|n| n.alive) {
        let client = NodeClient::new(cp, &node.row);
        let answer = client.usage(caller).await.map_err(|e| e.into_control(client.id()))?;
        total.sandboxes += answer.sandboxes;
        total.vcpus += answer.vcpus;
        total.memory_mib += answer.memory_mib;
        // Every field named, so that one added to the node's figures is
        // added up here too (or the build says why not).
        let DiskUsage {
            total_bytes,
            roots_reserved_bytes,
            roots_used_bytes,
            transcripts_bytes,
            snapshots_bytes,
            templates_bytes,
            uploads_bytes,
            volumes_reserved_bytes,
            volume_snapshots_bytes,
        } = answer.disk;
        let disk = &mut total.disk;
        disk.total_bytes += total_bytes;
        disk.roots_reserved_bytes += roots_reserved_bytes;
        disk.roots_used_bytes += roots_used_bytes;
        disk.transcripts_bytes += transcripts_bytes;
        disk.snapshots_bytes += snapshots_bytes;
        disk.templates_bytes += templates_bytes;
        disk.uploads_bytes += uploads_bytes;
        disk.volumes_reserved_bytes += volumes_reserved_bytes;
        disk.volume_snapshots_bytes += volume_snapshots_bytes;
    }
    Ok(axum::Json(total).into_response())
}

#[cfg(test)]
mod tests {
    use space_api::cluster::NodeReport;
    use space_store::NodeRow;

    use super::*;

    #[test]
    fn a_create_is_sized_by_what_it_names_else_by_its_templates_reported_defaults() {
        let node = |alive: bool, sizes: &[(&str, u32, u32)]| {
            let report = NodeReport {
                id: "n".into(),
                url: "http://n.test:1".into(),
                engine: "gvisor".into(),
                capacity_mib: 1024,
                promised_mib: 0,
                templates: vec!["base".into(), "big".into()],
                sandboxes: vec![],
                secrets_epoch: 0,
                engines: vec!["gvisor".into()],
                pinned: Default::default(),
                local: vec![],
                sizes: sizes
                    .iter()
                    .map(|(t, vcpus, memory_mib)| {
                        (t.to_string(), TemplateSize { vcpus: *vcpus, memory_mib: *memory_mib })
                    })
                    .collect(),
                volume_store: None,
            };
            let row =
                NodeRow { id: "n".into(), url: "http://n.test:1".into(), lease_until_ms: 0, report: String::new() };
            Node { row, report, alive }
        };
        let nodes = [node(false, &[("big", 8, 9999)]), node(true, &[("big", 4, 4096), ("base", 1, 512)])];
        let big = Wanted { template: "big", vcpus: None, memory_mib: None };
        assert_eq!(create_size(&big, &nodes), (4, 4096), "a live node's report, not a lost one's");
        let named = Wanted { template: "big", vcpus: Some(2), memory_mib: Some(1024) };
        assert_eq!(create_size(&named, &nodes), (2, 1024));
        let unknown = Wanted { template: "nowhere", vcpus: None, memory_mib: None };
        assert_eq!(create_size(&unknown, &nodes), (1, 512), "a template no node reports: the defaults of none set");
    }
}
