//! `space cp`: files and directories between here, a sandbox and a volume.

use anyhow::{bail, Context, Result};

use crate::client::{self, FilesOf};

/// `SBX:/path` or `vol:NAME:/path` as (whose files, path); anything else
/// is a local path.
pub(crate) fn remote(spec: &str) -> Option<(FilesOf<'_>, &str)> {
    if let Some(rest) = spec.strip_prefix("vol:") {
        let (volume, path) = rest.split_once(':')?;
        return (!volume.is_empty() && path.starts_with('/')).then_some((FilesOf::Volume(volume), path));
    }
    let (sandbox, path) = spec.split_once(':')?;
    (sandbox.starts_with("sbx_") && path.starts_with('/')).then_some((FilesOf::Sandbox(sandbox), path))
}

pub(crate) fn copy(client: &client::Client, from: &str, to: &str, mode: Option<String>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if from.starts_with("vol:") && remote(from).is_none() || to.starts_with("vol:") && remote(to).is_none() {
        bail!("a volume's file is vol:NAME:/absolute/path");
    }
    match (remote(from), remote(to)) {
        (None, Some((files, path))) => {
            let meta = std::fs::metadata(from).with_context(|| format!("reading {from}"))?;
            if meta.is_dir() {
                // A directory travels as a tar archive, unpacked into `path`.
                let mut builder = tar::Builder::new(Vec::new());
                builder.follow_symlinks(false);
                builder.append_dir_all(".", from).with_context(|| format!("archiving {from}"))?;
                let archive = builder.into_inner()?;
                return Ok(client.upload_tar_to(files, path, &archive)?);
            }
            if !meta.is_file() {
                bail!("{from} is neither a regular file nor a directory");
            }
            let file = std::fs::File::open(from).with_context(|| format!("opening {from}"))?;
            let mode = mode.unwrap_or_else(|| format!("{:04o}", meta.permissions().mode() & 0o7777));
            Ok(client.upload_to(files, path, Some(&mode), file)?)
        }
        (Some((files, path)), None) => {
            if client.is_dir_in(files, path)? {
                let archive = client.download_tar_from(files, path)?;
                return unpack_here(&archive, std::path::Path::new(to));
            }
            // Into a temporary file first: a failed copy leaves `to` as it was.
            let partial = format!("{to}.space-partial");
            let mut out = std::fs::File::create(&partial).with_context(|| format!("creating {partial}"))?;
            let copied = client
                .download_from(files, path, &mut out)
                .map_err(anyhow::Error::from)
                .and_then(|()| std::fs::rename(&partial, to).with_context(|| format!("renaming {partial} to {to}")));
            if copied.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            copied
        }
        // Between a sandbox and a volume (or two of either), through here.
        (Some((source, from_path)), Some((target, to_path))) => {
            if client.is_dir_in(source, from_path)? {
                let archive = client.download_tar_from(source, from_path)?;
                return Ok(client.upload_tar_to(target, to_path, &archive)?);
            }
            let mut bytes = Vec::new();
            client.download_from(source, from_path, &mut bytes)?;
            match mode {
                Some(mode) => client.upload_to(target, to_path, Some(&mode), &bytes[..])?,
                None => client.upload_bytes_to(target, to_path, &bytes)?,
            }
            Ok(())
        }
        (None, None) => bail!("give a SANDBOX:/absolute/path or vol:VOLUME:/absolute/path on one side"),
    }
}

/// Unpacks an archive that came out of a sandbox or a volume (so:
/// untrusted) into `dir`, refusing any entry that would land outside it.
pub(crate) fn unpack_here(archive: &[u8], dir: &std::path::Path) -> Result<()> {
    Ok(space_host::download::unpack_within(archive, dir)?)
}
