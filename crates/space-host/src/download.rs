//! Archives that come out of a sandbox (so: written by whatever runs
//! there), unpacked on a client's host by `space cp`.

use std::path::{Component, Path};

use crate::HostError;

/// Unpacks `archive` into `dir`, refusing any entry that would land
/// outside it: `..`, absolute paths, and paths through links the archive
/// made (the tar crate checks each entry's parent against `dir`).
pub fn unpack_within(archive: &[u8], dir: &Path) -> Result<(), HostError> {
    let io = |what: &'static str| move |e: std::io::Error| HostError::Invalid(format!("{what}: {e}"));
    std::fs::create_dir_all(dir).map_err(HostError::io(format!("creating {}", dir.display())))?;
    let mut archive = tar::Archive::new(archive);
    for entry in archive.entries().map_err(io("reading the archive"))? {
        let mut entry = entry.map_err(io("reading the archive"))?;
        let name = entry.path().map_err(io("an entry's name"))?.into_owned();
        let outside =
            name.components().any(|c| matches!(c, Component::ParentDir | Component::RootDir | Component::Prefix(_)));
        if outside || !entry.unpack_in(dir).map_err(io("unpacking"))? {
            return Err(HostError::Invalid(format!(
                "the archive's entry {} would land outside {}",
                name.display(),
                dir.display()
            )));
        }
    }
    Ok(())
}
