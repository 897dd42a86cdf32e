//! A built template as it lies in the data dir: a version's directory and
//! the `template.json` that marks it complete, and the rule for names.
//! Only the description: the data dir finds templates by it and the
//! builders (`template`, `oci`) write it, so it depends on neither.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::HostError;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateDefaults {
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub user: String,
    /// The network its sandboxes get when their create names none (the
    /// API's `Network`, checked by the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<serde_json::Value>,
    /// The start command recorded for the template's users (an image's
    /// `ENTRYPOINT` + `CMD`); never run by the platform.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
}

impl Default for TemplateDefaults {
    fn default() -> Self {
        TemplateDefaults {
            vcpus: 1,
            memory_mib: 512,
            disk_mib: 2048,
            env: BTreeMap::new(),
            workdir: "/root".into(),
            user: "root".into(),
            network: None,
            command: None,
        }
    }
}

/// `template.json`, written last: its presence marks a complete build.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateMeta {
    pub name: String,
    pub version: u32,
    pub created_at: String,
    pub source: serde_json::Value,
    pub defaults: TemplateDefaults,
    /// Warm sandboxes to keep for this template; the server's setting when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_pool: Option<u32>,
    /// Running (hot) sandboxes to keep for it; the server's setting when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_pool: Option<u32>,
    /// The tenant it belongs to; `None`: shared by every tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The engine its sandboxes run on; `None`: the server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// A snapshot template: its sandboxes wake from this saved state (the
    /// root beside it and the memory in `memory/`) instead of booting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<TemplateImage>,
}

impl TemplateMeta {
    /// The record of a build not yet published: its version and time are
    /// set when it is.
    pub fn unpublished(
        name: &str,
        source: serde_json::Value,
        defaults: TemplateDefaults,
        owner: Option<String>,
        engine: Option<String>,
    ) -> TemplateMeta {
        TemplateMeta {
            name: name.to_string(),
            version: 0,
            created_at: String::new(),
            source,
            defaults,
            warm_pool: None,
            hot_pool: None,
            owner,
            engine,
            image: None,
        }
    }
}

/// How the agent saved in a snapshot template greets its host.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TemplateImage {
    /// The host session it knows (it keeps its streams under it).
    pub agent_session: u64,
    /// The key it presents when it dials (kept only on the host).
    pub channel_key: String,
}

#[derive(Debug, Clone)]
pub struct TemplateInfo {
    pub meta: TemplateMeta,
    pub dir: PathBuf,
}

impl TemplateInfo {
    pub fn load(dir: &Path) -> Result<TemplateInfo, HostError> {
        let path = dir.join("template.json");
        let text = fs::read_to_string(&path).map_err(HostError::io(format!("reading {}", path.display())))?;
        let meta = serde_json::from_str(&text).map_err(|e| HostError::Invalid(format!("{}: {e}", path.display())))?;
        Ok(TemplateInfo { meta, dir: dir.to_path_buf() })
    }

    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
}

/// Template names: short, lowercase, safe as a path component.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names_are_path_safe() {
        assert!(valid_name("base"));
        assert!(valid_name("py-data_2"));
        for bad in ["", "..", "a/b", "Base", "-x", &"x".repeat(64)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
