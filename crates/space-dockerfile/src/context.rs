//! COPY and ADD from the build context: reads the context tar once and
//! writes a layer tar holding what the step selects, renamed under its
//! destination, owned by `--chown` (root otherwise, as in Docker) and with
//! `--chmod`'s mode.
//!
//! The layer holds no entry for the destination or the directories above
//! it: applying an entry for an existing directory would replace its owner
//! and mode (`COPY x /tmp/` must not take /tmp's sticky bit), and the layer
//! applier creates missing parents. Directories between the destination and
//! a copied file are in the layer, made up when the context has none.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufReader, Read, Write};

use sha2::{Digest, Sha256};

use crate::cache_key::{hex, Fields};
use crate::dockerignore::Ignore;
use crate::glob::{self, clean, Token};
use crate::model::{CopyFrom, CopyStep};

/// What a COPY layer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyStats {
    /// Files, symlinks and hard links written (directories are not counted).
    pub files: u64,
    /// Bytes of file content written.
    pub bytes: u64,
    /// sha256 over the sorted (path, type, mode, uid, gid, content sha256 or
    /// link target) of every entry written: the step's cache input.
    pub digest_of_inputs: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("COPY failed: file not found in build context or excluded by .dockerignore: {0}")]
    NotFound(String),
    #[error("COPY failed: {0:?} is outside the build context")]
    OutsideContext(String),
    #[error("--chown={0}: a layer takes numeric ids (uid[:gid]); names are looked up in the image first")]
    OwnerName(String),
    #[error("COPY failed: {0:?} matches more than one file: the destination must be a directory ending in /")]
    ManyToOneFile(String),
    #[error("the build context has a member outside its root: {0:?}")]
    BadMember(String),
    #[error("the build context has a hard link {path:?} to {target:?}, which this COPY does not copy")]
    HardLink { path: String, target: String },
    #[error("{0}: only the build context is copied here")]
    NotFromContext(String),
    #[error("unpacking {archive}: {source}")]
    Archive {
        archive: String,
        #[source]
        source: io::Error,
    },
    #[error("reading the build context or writing the layer: {0}")]
    Io(#[from] io::Error),
}

/// Writes the layer of `step` (from the context) to `out`.
pub fn copy_layer(
    context: impl Read,
    ignore: &Ignore,
    step: &CopyStep,
    out: impl Write,
) -> Result<CopyStats, CopyError> {
    if step.from != CopyFrom::Context {
        return Err(CopyError::NotFromContext(format!("{:?}", step.from)));
    }
    let owner = step.chown.as_deref().map(parse_owner).transpose()?;
    let mut sources = step.sources.iter().map(|s| Selector::new(s)).collect::<Result<Vec<_>, _>>()?;
    let into_dir = step.dest.ends_with('/') || step.sources.len() > 1;
    let dest_base = step.dest.trim_matches('/').to_string();
    let mut layer = Layer {
        tar: tar::Builder::new(out),
        dest_base,
        owner,
        chmod: step.chmod,
        dirs: BTreeSet::new(),
        copied: BTreeMap::new(),
        records: Vec::new(),
        files: 0,
        bytes: 0,
    };
    let mut single_file_target: Option<String> = None;
    let mut archive = tar::Archive::new(context);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let path = clean(raw.trim_start_matches('/'));
        if path == ".." || path.starts_with("../") {
            return Err(CopyError::BadMember(raw));
        }
        if path == "." || ignore.is_excluded(&path) {
            continue;
        }
        let Some((index, selected)) = sources.iter().enumerate().find_map(|(i, s)| s.select(&path).map(|sel| (i, sel)))
        else {
            continue;
        };
        sources[index].found = true;
        let kind = entry.header().entry_type();
        let itself = matches!(selected, Selected::Itself);
        let target = match selected {
            // A directory named by a source stands for its contents.
            Selected::Itself if kind.is_dir() => continue,
            Selected::Itself if into_dir => join(&layer.dest_base, basename(&path)),
            Selected::Itself => {
                if let Some(first) = &single_file_target {
                    if *first != path {
                        return Err(CopyError::ManyToOneFile(sources[index].raw.clone()));
                    }
                }
                single_file_target = Some(path.clone());
                layer.dest_base.clone()
            }
            Selected::Below(rel) => join(&layer.dest_base, &rel),
        };
        if step.unpack && itself && kind.is_file() {
            if let Some(decoder) = archive_decoder(&path) {
                layer.unpack(&path, decoder(Box::new(&mut entry))?)?;
                continue;
            }
        }
        layer.entry(&path, &target, &mut entry)?;
    }
    if let Some(missing) = sources.iter().find(|s| !s.found) {
        return Err(CopyError::NotFound(missing.raw.clone()));
    }
    layer.finish()
}

/// `uid[:gid]`; a uid alone is its own gid, as in Docker.
fn parse_owner(chown: &str) -> Result<(u64, u64), CopyError> {
    let name = || CopyError::OwnerName(chown.to_string());
    let (user, group) = chown.split_once(':').unwrap_or((chown, chown));
    let uid = user.parse::<u64>().map_err(|_| name())?;
    let gid = group.parse::<u64>().map_err(|_| name())?;
    Ok((uid, gid))
}

/// One COPY source, cleaned against the context root.
struct Selector {
    raw: String,
    path: String,
    tokens: Option<Vec<Token>>,
    found: bool,
}

enum Selected {
    /// The member is what the source names.
    Itself,
    /// The member is below a directory the source names, at this path.
    Below(String),
}

impl Selector {
    fn new(raw: &str) -> Result<Selector, CopyError> {
        let path = clean(raw.trim_start_matches('/'));
        if path == ".." || path.starts_with("../") {
            return Err(CopyError::OutsideContext(raw.to_string()));
        }
        let tokens = if path.contains(['*', '?', '[', '\\']) {
            Some(glob::compile(&path, false).map_err(|e| CopyError::NotFound(e.to_string()))?)
        } else {
            None
        };
        Ok(Selector { raw: raw.to_string(), path, tokens, found: false })
    }

    fn select(&self, member: &str) -> Option<Selected> {
        let named = |candidate: &str| match &self.tokens {
            Some(tokens) => glob::matches(tokens, candidate),
            None => self.path == "." || candidate == self.path,
        };
        if self.path == "." && self.tokens.is_none() {
            return Some(Selected::Below(member.to_string()));
        }
        // The shortest named ancestor wins: its whole tree is copied.
        for (at, _) in member.match_indices('/') {
            if named(&member[..at]) {
                return Some(Selected::Below(member[at + 1..].to_string()));
            }
        }
        named(member).then_some(Selected::Itself)
    }
}

type Decoder = fn(Box<dyn Read + '_>) -> io::Result<Box<dyn Read + '_>>;

fn archive_decoder(path: &str) -> Option<Decoder> {
    let lower = path.to_ascii_lowercase();
    if lower.ends_with(".tar") {
        Some(|r| Ok(r))
    } else if lower.ends_with(".tar.gz") || lower.ends_with(".tgz") {
        Some(|r| Ok(Box::new(flate2::read::MultiGzDecoder::new(r))))
    } else if lower.ends_with(".tar.zst") {
        Some(|r| {
            let mut decoder = zstd::stream::read::Decoder::with_buffer(BufReader::new(r))?;
            // At most 128 MiB of window, as for image layers.
            decoder.window_log_max(27)?;
            Ok(Box::new(decoder))
        })
    } else {
        None
    }
}

struct Layer<W: Write> {
    tar: tar::Builder<W>,
    /// The destination without its leading and trailing `/`; "" for the root.
    dest_base: String,
    owner: Option<(u64, u64)>,
    chmod: Option<u32>,
    /// Directories already in the layer.
    dirs: BTreeSet<String>,
    /// Context path → layer path of what was copied, for hard links.
    copied: BTreeMap<String, String>,
    records: Vec<Record>,
    files: u64,
    bytes: u64,
}

struct Record {
    path: String,
    kind: u8,
    mode: u32,
    uid: u64,
    gid: u64,
    content: String,
}

impl<W: Write> Layer<W> {
    /// Copies one context member to `target` in the layer.
    fn entry<R: Read>(&mut self, source: &str, target: &str, entry: &mut tar::Entry<R>) -> Result<(), CopyError> {
        let (uid, gid) = self.owner.unwrap_or((0, 0));
        let mode = match self.chmod {
            Some(mode) => mode,
            None => link_or_mode(entry.header())?,
        };
        let link = entry.link_name()?.map(|l| l.to_string_lossy().into_owned());
        let (kind, mtime, size) = (entry.header().entry_type(), entry.header().mtime()?, entry.size());
        self.write(source, target, kind, mode, (uid, gid), mtime, size, link, entry)
    }

    /// Unpacks the archive `source` into the destination directory: its
    /// owners stay unless `--chown` is given.
    fn unpack(&mut self, source: &str, reader: Box<dyn Read + '_>) -> Result<(), CopyError> {
        let failed = |e: io::Error| CopyError::Archive { archive: source.to_string(), source: e };
        let mut inner = tar::Archive::new(reader);
        let mut copied = BTreeMap::new();
        std::mem::swap(&mut copied, &mut self.copied);
        for entry in inner.entries().map_err(failed)? {
            let mut entry = entry.map_err(failed)?;
            let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            let path = clean(raw.trim_start_matches('/'));
            if path == ".." || path.starts_with("../") {
                return Err(failed(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("member {raw:?} leaves the archive"),
                )));
            }
            if path == "." {
                continue;
            }
            let header = entry.header();
            let owner = match self.owner {
                Some(owner) => owner,
                None => (header.uid().map_err(failed)?, header.gid().map_err(failed)?),
            };
            let mode = link_or_mode(header).map_err(failed)?;
            let (kind, mtime, size) = (header.entry_type(), header.mtime().map_err(failed)?, entry.size());
            let link = entry.link_name().map_err(failed)?.map(|l| l.to_string_lossy().into_owned());
            let target = join(&self.dest_base, &path);
            self.write(&path, &target, kind, mode, owner, mtime, size, link, &mut entry)?;
        }
        // Hard links inside the archive point at its own members only.
        self.copied = copied;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        source: &str,
        target: &str,
        kind: tar::EntryType,
        mode: u32,
        (uid, gid): (u64, u64),
        mtime: u64,
        size: u64,
        link: Option<String>,
        data: &mut dyn Read,
    ) -> Result<(), CopyError> {
        self.parents(target)?;
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_uid(uid);
        header.set_gid(gid);
        header.set_mtime(mtime);
        header.set_size(0);
        let record = |kind: u8, content: String| Record { path: target.to_string(), kind, mode, uid, gid, content };
        if kind.is_dir() {
            self.tar.append_data(&mut header, format!("{target}/"), io::empty())?;
            self.dirs.insert(target.to_string());
            self.records.push(record(b'd', String::new()));
        } else if kind.is_file() {
            // The member's header gave its size, and its reader ends there.
            header.set_size(size);
            let mut hashing = Hashing { inner: data, hasher: Sha256::new() };
            self.tar.append_data(&mut header, target, &mut hashing)?;
            self.records.push(record(b'f', hex(&hashing.hasher.finalize())));
            self.files += 1;
            self.bytes += size;
            self.copied.insert(source.to_string(), target.to_string());
        } else if kind.is_symlink() {
            let link = link.unwrap_or_default();
            header.set_mode(0o777);
            self.tar.append_link(&mut header, target, &link)?;
            self.files += 1;
            self.records.push(record(b'l', link));
        } else if kind.is_hard_link() {
            let link = clean(link.unwrap_or_default().trim_start_matches('/'));
            let Some(linked) = self.copied.get(&link).cloned() else {
                return Err(CopyError::HardLink { path: source.to_string(), target: link });
            };
            self.tar.append_link(&mut header, target, &linked)?;
            self.files += 1;
            self.records.push(record(b'h', linked));
        }
        // Devices and fifos are never copied from a context.
        Ok(())
    }

    /// Adds the directories between the destination and `target`.
    fn parents(&mut self, target: &str) -> Result<(), CopyError> {
        let below = if self.dest_base.is_empty() { 0 } else { self.dest_base.len() + 1 };
        let (uid, gid) = self.owner.unwrap_or((0, 0));
        for (at, _) in target.match_indices('/') {
            let dir = &target[..at];
            if at < below || self.dirs.contains(dir) {
                continue;
            }
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Directory);
            header.set_mode(0o755);
            header.set_uid(uid);
            header.set_gid(gid);
            header.set_size(0);
            self.tar.append_data(&mut header, format!("{dir}/"), io::empty())?;
            self.dirs.insert(dir.to_string());
            self.records.push(Record {
                path: dir.to_string(),
                kind: b'd',
                mode: 0o755,
                uid,
                gid,
                content: String::new(),
            });
        }
        Ok(())
    }

    fn finish(mut self) -> Result<CopyStats, CopyError> {
        self.tar.finish()?;
        self.records.sort_by(|a, b| a.path.cmp(&b.path).then(a.kind.cmp(&b.kind)));
        let mut fields = Fields::default();
        fields.number(self.records.len() as u64);
        for r in &self.records {
            fields.put(&r.path).bytes(&[r.kind]).number(r.mode.into()).number(r.uid).number(r.gid).put(&r.content);
        }
        Ok(CopyStats { files: self.files, bytes: self.bytes, digest_of_inputs: fields.finish() })
    }
}

struct Hashing<'a> {
    inner: &'a mut dyn Read,
    hasher: Sha256,
}

impl Read for Hashing<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// A member's permission bits; links have none of their own.
fn link_or_mode(header: &tar::Header) -> io::Result<u32> {
    let kind = header.entry_type();
    if kind.is_symlink() || kind.is_hard_link() {
        Ok(0o777)
    } else {
        Ok(header.mode()? & 0o7777)
    }
}

fn join(base: &str, rel: &str) -> String {
    if base.is_empty() {
        rel.to_string()
    } else if rel.is_empty() {
        base.to_string()
    } else {
        format!("{base}/{rel}")
    }
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}
