//! What a cluster's control plane and its nodes say to each other
//! (decision 009): a node's heartbeat report, its event feed's lines, a
//! template pull, the tenant's disk allowance and the headers that carry
//! the caller and the answering node. Both sides read these types, so
//! neither re-invents the other's defaults.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How often a node reports, and how long a report keeps it alive.
pub const HEARTBEAT: Duration = Duration::from_secs(2);
pub const LEASE: Duration = Duration::from_secs(10);

/// A node's report, answered with the cluster's secrets when the node's are
/// older (`POST`, on the control plane).
pub const HEARTBEAT_PATH: &str = "/internal/v1/nodes/heartbeat";
/// A node's events after `?after=N` and each one as it commits, as NDJSON
/// lines of [`FeedEvent`] (`GET`, on a node).
pub const EVENTS_PATH: &str = "/internal/v1/events";
/// The cluster's secrets as of a change (`POST`, on a node).
pub const SECRETS_PATH: &str = "/internal/v1/secrets";
/// Fetch a template from another node: a [`PullRequest`] (`POST`, on a node).
pub const TEMPLATE_PULL_PATH: &str = "/internal/v1/templates/pull";

/// A template's archive on a node (`GET`): a tar of its root, its SHA-256
/// in [`TEMPLATE_SHA256_HEADER`], its `template.json` (base64) in
/// [`TEMPLATE_META_HEADER`].
pub fn template_export_path(name: &str) -> String {
    format!("/internal/v1/templates/{name}")
}

/// Let go of a volume of the shared store for another node to take: a
/// [`ReleaseVolume`] (`POST`, on a node), answered a [`HandedVolume`].
pub const VOLUME_RELEASE_PATH: &str = "/internal/v1/volumes/release";
/// Take a volume of the shared store another node let go of: a
/// [`HandedVolume`] (`POST`, on a node), answered the `Volume`.
pub const VOLUME_ADOPT_PATH: &str = "/internal/v1/volumes/adopt";

/// Which volume a node is to let go of (decision 032).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseVolume {
    pub tenant: String,
    pub name: String,
}

/// A volume of a shared store one node let go of, with what another needs
/// to take it: its records (its image holds the rest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedVolume {
    /// The shared store it is in; a node of another store refuses it.
    pub store: String,
    pub tenant: String,
    /// `vol_…`: its image's name.
    pub id: String,
    pub name: String,
    pub size_mib: u32,
    pub created_at: crate::Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<crate::SnapshotRef>,
    pub snapshots: Vec<HandedSnapshot>,
}

/// A snapshot of a [`HandedVolume`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedSnapshot {
    pub name: String,
    pub created_at: crate::Timestamp,
}

/// The tenant a request from the control plane is made for.
pub const TENANT_HEADER: &str = "x-space-tenant";
/// `true` when that tenant is the operator (the cluster's own key).
pub const OPERATOR_HEADER: &str = "x-space-operator";
/// On the control plane's answers: the node that answered.
pub const NODE_HEADER: &str = "x-space-node";
/// The tenant's [`DiskAllowance`], on a request that may make it hold more disk.
pub const DISK_QUOTA_HEADER: &str = "x-space-disk-quota";
pub const TEMPLATE_SHA256_HEADER: &str = "x-space-sha256";
pub const TEMPLATE_META_HEADER: &str = "x-space-template";

/// What a node tells the control plane with every heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeReport {
    pub id: String,
    /// Where the control plane reaches it (`http://host:port`).
    pub url: String,
    pub engine: String,
    pub capacity_mib: u64,
    pub promised_mib: u64,
    pub templates: Vec<String>,
    /// Sandboxes that hold its resources (not deleted or failed).
    pub sandboxes: Vec<String>,
    /// The change of the cluster's secrets it holds (0: none).
    #[serde(default)]
    pub secrets_epoch: u64,
    /// The engines it can run (its default is `engine`).
    #[serde(default)]
    pub engines: Vec<String>,
    /// Templates whose sandboxes must run on one engine, and that engine.
    #[serde(default)]
    pub pinned: BTreeMap<String, String>,
    /// Snapshot templates it holds: they stay here (never spread).
    #[serde(default)]
    pub local: Vec<String>,
    /// Each template's default size, which a create that names none gets:
    /// the control plane counts a tenant's quotas and a node's room by it.
    #[serde(default)]
    pub sizes: BTreeMap<String, TemplateSize>,
    /// The shared store its volumes are kept in (decision 032): nodes that
    /// name the same one hand volumes over without a copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_store: Option<String>,
}

impl NodeReport {
    /// Whether a sandbox of `template` (that must run on `engine`, if
    /// named) can start here.
    pub fn can_run(&self, template: &str, engine: Option<&str>) -> bool {
        self.templates.iter().any(|t| t == template)
            && engine.is_none_or(|e| e == self.engine || self.engines.iter().any(|have| have == e))
    }
}

/// A template's default vCPUs and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSize {
    pub vcpus: u32,
    pub memory_mib: u32,
}

/// The control plane's request that a node fetch a template from another.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullRequest {
    /// The node that has it (`http://host:port`).
    pub from: String,
    pub name: String,
}

/// The query of a node's event feed.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedQuery {
    /// Events after this one (0: all it keeps).
    #[serde(default)]
    pub after: u64,
}

/// An event as a node passes it to the control plane: every tenant's, in
/// its stored form (the body with id 0), under the node's own id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FeedEvent {
    pub seq: u64,
    pub tenant: String,
    pub sandbox_id: Option<String>,
    pub kind: String,
    pub body: String,
}

/// What the control plane tells a node of a tenant's disk quota, with a
/// request that may make the tenant hold more disk there (a create, a
/// suspend, a checkpoint, a fork, a template build): the node counts it
/// with what the tenant holds there. In [`DISK_QUOTA_HEADER`] as
/// `MAX_MIB/ELSEWHERE_BYTES`, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskAllowance {
    /// The tenant has no disk quota.
    Unlimited,
    Quota {
        /// What it may hold in all.
        max_mib: u64,
        /// What it holds on the other live nodes.
        elsewhere_bytes: u64,
    },
}

impl DiskAllowance {
    /// The header's text.
    pub fn to_header(&self) -> String {
        match self {
            DiskAllowance::Unlimited => "none".to_string(),
            DiskAllowance::Quota { max_mib, elsewhere_bytes } => format!("{max_mib}/{elsewhere_bytes}"),
        }
    }

    /// Reads the header's text.
    pub fn from_header(text: &str) -> Result<DiskAllowance, String> {
        if text == "none" {
            return Ok(DiskAllowance::Unlimited);
        }
        text.split_once('/')
            .and_then(|(max, elsewhere)| {
                Some(DiskAllowance::Quota { max_mib: max.parse().ok()?, elsewhere_bytes: elsewhere.parse().ok()? })
            })
            .ok_or_else(|| format!("{DISK_QUOTA_HEADER} is MAX_MIB/ELSEWHERE_BYTES or `none`"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(engine: &str, engines: &[&str], templates: &[&str]) -> NodeReport {
        NodeReport {
            id: "n".into(),
            url: "http://n.test:1".into(),
            engine: engine.into(),
            capacity_mib: 1024,
            promised_mib: 0,
            templates: templates.iter().map(|t| t.to_string()).collect(),
            sandboxes: vec![],
            secrets_epoch: 0,
            engines: engines.iter().map(|e| e.to_string()).collect(),
            pinned: Default::default(),
            local: vec![],
            sizes: Default::default(),
            volume_store: None,
        }
    }

    #[test]
    fn a_node_runs_a_template_it_has_on_an_engine_it_can_run() {
        let gvisor = report("gvisor", &["gvisor"], &["base", "vm"]);
        let both = report("firecracker", &["firecracker", "gvisor"], &["base", "vm"]);
        assert!(gvisor.can_run("base", None) && both.can_run("base", None));
        assert!(!gvisor.can_run("other", None), "a template it lacks");
        assert!(!gvisor.can_run("vm", Some("firecracker")), "an engine it cannot run");
        assert!(both.can_run("vm", Some("firecracker")) && both.can_run("vm", Some("gvisor")));
        // A report from before engines were reported: its default engine.
        let old = report("gvisor", &[], &["base"]);
        assert!(old.can_run("base", Some("gvisor")) && !old.can_run("base", Some("firecracker")));
    }

    #[test]
    fn a_report_without_the_newer_fields_still_reads() {
        let old = r#"{"id":"n","url":"http://n.test:1","engine":"gvisor","capacity_mib":1,"promised_mib":0,
            "templates":["base"],"sandboxes":[]}"#;
        let report: NodeReport = serde_json::from_str(old).unwrap();
        assert!(report.engines.is_empty() && report.pinned.is_empty() && report.secrets_epoch == 0);
        assert!(report.local.is_empty() && report.sizes.is_empty());
    }

    #[test]
    fn a_disk_allowance_reads_back_as_it_was_written_and_nothing_else_reads() {
        for allowance in [DiskAllowance::Unlimited, DiskAllowance::Quota { max_mib: 2048, elsewhere_bytes: 7 }] {
            assert_eq!(DiskAllowance::from_header(&allowance.to_header()), Ok(allowance));
        }
        assert_eq!(DiskAllowance::Quota { max_mib: 1, elsewhere_bytes: 0 }.to_header(), "1/0");
        for wrong in ["", "1", "1/", "/2", "a/2", "1/-2", "None"] {
            assert!(DiskAllowance::from_header(wrong).is_err(), "{wrong:?} read");
        }
    }

    #[test]
    fn a_feed_query_takes_after_or_none_and_nothing_else() {
        let query: FeedQuery = serde_json::from_str(r#"{"after": 5}"#).unwrap();
        assert_eq!(query.after, 5);
        assert_eq!(serde_json::from_str::<FeedQuery>("{}").unwrap().after, 0);
        assert!(serde_json::from_str::<FeedQuery>(r#"{"afterr": 5}"#).is_err());
    }
}
