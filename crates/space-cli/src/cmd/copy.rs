//! `space cp`: files and directories between here and a sandbox.

use anyhow::{bail, Context, Result};

use crate::client;

/// `SBX:/path` as (sandbox, path); anything else is a local path.
pub(crate) fn remote(spec: &str) -> Option<(&str, &str)> {
    let (sandbox, path) = spec.split_once(':')?;
    (sandbox.starts_with("sbx_") && path.starts_with('/')).then_some((sandbox, path))
}

pub(crate) fn copy(client: &client::Client, from: &str, to: &str, mode: Option<String>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    match (remote(from), remote(to)) {
        (None, Some((sandbox, path))) => {
            let meta = std::fs::metadata(from).with_context(|| format!("reading {from}"))?;
            if meta.is_dir() {
                // A directory travels as a tar archive, unpacked into `path`.
                let mut builder = tar::Builder::new(Vec::new());
                builder.follow_symlinks(false);
                builder.append_dir_all(".", from).with_context(|| format!("archiving {from}"))?;
                let archive = builder.into_inner()?;
                return Ok(client.upload_tar(sandbox, path, archive)?);
            }
            if !meta.is_file() {
                bail!("{from} is neither a regular file nor a directory");
            }
            let file = std::fs::File::open(from).with_context(|| format!("opening {from}"))?;
            let mode = mode.unwrap_or_else(|| format!("{:04o}", meta.permissions().mode() & 0o7777));
            Ok(client.upload(sandbox, path, &mode, file)?)
        }
        (Some((sandbox, path)), None) => {
            if client.is_dir(sandbox, path)? {
                let archive = client.download_tar(sandbox, path)?;
                return unpack_here(&archive, std::path::Path::new(to));
            }
            // Into a temporary file first: a failed copy leaves `to` as it was.
            let partial = format!("{to}.space-partial");
            let mut out = std::fs::File::create(&partial).with_context(|| format!("creating {partial}"))?;
            let copied = client
                .download(sandbox, path, &mut out)
                .map_err(anyhow::Error::from)
                .and_then(|()| std::fs::rename(&partial, to).with_context(|| format!("renaming {partial} to {to}")));
            if copied.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            copied
        }
        _ => bail!("give one local path and one SANDBOX:/absolute/path"),
    }
}

/// Unpacks an archive that came out of a sandbox (so: untrusted) into
/// `dir`, refusing any entry that would land outside it.
pub(crate) fn unpack_here(archive: &[u8], dir: &std::path::Path) -> Result<()> {
    Ok(space_host::download::unpack_within(archive, dir)?)
}
