//! The server roles `space` runs: a single server or a cluster's node
//! (`serve`), a cluster's control plane (`control`) and the root helper
//! (`helper`), with what they share: logging, secret files and the dev key.

mod control;
mod helper;
mod serve;

use std::path::Path;

use anyhow::{bail, Context, Result};

pub(crate) use self::control::control_plane;
pub(crate) use self::helper::helper;
pub(crate) use self::serve::serve;
use crate::cli::LogFormat;

pub(crate) fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).init(),
    }
}

/// What a node adds to `serve`.
pub(crate) struct NodeRole {
    pub(crate) control_plane: String,
    pub(crate) id: String,
    pub(crate) advertise: Option<String>,
}

pub(crate) fn read_secret_file(path: &Path, what: &str) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let text = text.trim().to_string();
    if text.len() < 16 {
        bail!("the {what} in {} is shorter than 16 characters", path.display());
    }
    Ok(text)
}

/// The dev key: created once (0600), then reused; two servers starting at
/// once on a fresh data dir get the same one.
pub(crate) fn dev_key(path: &Path) -> Result<String> {
    let content = space_host::datadir::create_once(path, 0o600, || {
        let mut bytes = [0u8; 24];
        getrandom::getrandom(&mut bytes).map_err(std::io::Error::other)?;
        Ok(format!("space_dev_{}\n", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()).into_bytes())
    })
    .with_context(|| format!("the dev key ({})", path.display()))?;
    let key = String::from_utf8_lossy(&content).trim().to_string();
    anyhow::ensure!(!key.is_empty(), "the dev key file {} is empty: remove it to make a new one", path.display());
    Ok(key)
}
