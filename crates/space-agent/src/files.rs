//! File operations on paths inside the sandbox (or, in the volume files
//! child, inside the volume: its root directory). Paths are resolved by
//! this (sandboxed or confined) process, so `..` and symlinks can only
//! ever lead to other paths of its own view.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};

use space_proto::{
    DirEntry, FileError, FileFailure, FileInfo, FileListing, FileRequest, Frame, FrameKind, PathInfo, PathOpKind,
    PathRequest, MAX_OUTPUT_CHUNK,
};

use crate::pool;

/// Files being written, by stream.
pub type Uploads = Arc<Mutex<HashMap<u32, Result<Sink, FileError>>>>;

fn failure(err: std::io::Error, path: &str) -> FileError {
    let reason = match err.kind() {
        ErrorKind::NotFound => FileFailure::NotFound,
        ErrorKind::PermissionDenied => FileFailure::PermissionDenied,
        ErrorKind::IsADirectory | ErrorKind::NotADirectory => FileFailure::WrongType,
        ErrorKind::DirectoryNotEmpty => FileFailure::NotEmpty,
        ErrorKind::InvalidInput => FileFailure::Invalid,
        ErrorKind::AlreadyExists => FileFailure::Exists,
        _ => FileFailure::Io,
    };
    FileError { reason, message: format!("{path}: {err}") }
}

fn absolute(path: &str) -> Result<&Path, FileError> {
    if path.starts_with('/') && !path.contains('\0') {
        Ok(Path::new(path))
    } else {
        Err(FileError { reason: FileFailure::Invalid, message: format!("not an absolute path: {path:?}") })
    }
}

/// Sends a file's bytes, or a directory's listing, on `stream`.
pub fn read(stream: u32, request: FileRequest, outbox: &SyncSender<Frame>) {
    let outbox = outbox.clone();
    pool::run(move || {
        let send = |frame: Frame| outbox.send(frame).is_ok();
        let result = (|| -> Result<(), FileError> {
            let path = absolute(&request.path)?;
            let meta = fs::metadata(path).map_err(|e| failure(e, &request.path))?;
            if request.tar {
                if !meta.is_dir() {
                    return Err(FileError {
                        reason: FileFailure::WrongType,
                        message: format!("{}: not a directory", request.path),
                    });
                }
                // The size of an archive is not known before it is written.
                send(Frame::message(stream, FrameKind::FileInfo, &FileInfo { size: 0, mode: meta.mode() & 0o7777 }));
                let mut builder = tar::Builder::new(FrameWriter { stream, outbox: outbox.clone(), buf: Vec::new() });
                builder.follow_symlinks(false);
                builder.append_dir_all(".", path).map_err(|e| failure(e, &request.path))?;
                let mut writer = builder.into_inner().map_err(|e| failure(e, &request.path))?;
                writer.flush().map_err(|e| failure(e, &request.path))?;
                send(Frame::new(stream, FrameKind::FileEnd, Vec::new()));
                return Ok(());
            }
            if meta.is_dir() {
                let mut entries = Vec::new();
                let names = crate::users::Names::read();
                for entry in fs::read_dir(path).map_err(|e| failure(e, &request.path))?.flatten() {
                    let Ok(meta) = entry.path().symlink_metadata() else { continue };
                    let target = meta.file_type().is_symlink().then(|| fs::read_link(entry.path()).ok()).flatten();
                    entries.push(DirEntry {
                        name: entry.file_name().to_string_lossy().into_owned(),
                        kind: kind_of(&meta).into(),
                        size: meta.len(),
                        mode: meta.mode() & 0o7777,
                        mtime: meta.mtime(),
                        owner: Some(names.user(meta.uid())),
                        group: Some(names.group(meta.gid())),
                        target: target.map(|t| t.to_string_lossy().into_owned()),
                    });
                }
                entries.sort_by(|a, b| a.name.cmp(&b.name));
                send(Frame::message(stream, FrameKind::FileListing, &FileListing { entries }));
                return Ok(());
            }
            let mut file = File::open(path).map_err(|e| failure(e, &request.path))?;
            send(Frame::message(
                stream,
                FrameKind::FileInfo,
                &FileInfo { size: meta.len(), mode: meta.mode() & 0o7777 },
            ));
            let mut buf = vec![0u8; MAX_OUTPUT_CHUNK];
            loop {
                let n = file.read(&mut buf).map_err(|e| failure(e, &request.path))?;
                if n == 0 {
                    break;
                }
                if !send(Frame::new(stream, FrameKind::FileData, buf[..n].to_vec())) {
                    return Ok(());
                }
            }
            send(Frame::new(stream, FrameKind::FileEnd, Vec::new()));
            Ok(())
        })();
        if let Err(error) = result {
            send(Frame::message(stream, FrameKind::FileFailed, &error));
        }
    });
}

/// Sends what is written to it as `FileData` frames of at most one chunk.
struct FrameWriter {
    stream: u32,
    outbox: SyncSender<Frame>,
    buf: Vec<u8>,
}

impl Write for FrameWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= MAX_OUTPUT_CHUNK {
            self.flush()?;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        for chunk in self.buf.chunks(MAX_OUTPUT_CHUNK) {
            self.outbox
                .send(Frame::new(self.stream, FrameKind::FileData, chunk.to_vec()))
                .map_err(|_| std::io::Error::other("the host went away"))?;
        }
        self.buf.clear();
        Ok(())
    }
}

/// Reads the chunks of an upload as they arrive (for unpacking a tar).
struct ChunkReader {
    chunks: std::sync::mpsc::Receiver<Vec<u8>>,
    current: std::io::Cursor<Vec<u8>>,
}

impl Read for ChunkReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let n = self.current.read(out)?;
            if n > 0 || out.is_empty() {
                return Ok(n);
            }
            match self.chunks.recv() {
                Ok(chunk) => self.current = std::io::Cursor::new(chunk),
                Err(_) => return Ok(0), // the upload ended
            }
        }
    }
}

/// Unpacks an archive into `dir` whole or not at all, refusing (not
/// skipping) any entry whose path would lead outside it. The entries land
/// first in a staging directory inside `dir` (the same filesystem, so
/// moving them is a rename); only once the whole archive is in and none was
/// refused are they moved into place, merged with what `dir` holds (the
/// archive's files replace those of the same name, the rest stay, as
/// unpacking in place did). A refused archive leaves nothing behind.
fn unpack(archive: tar::Archive<ChunkReader>, dir: &Path, shown: &str) -> Result<(), FileError> {
    let staging = staging_dir(dir).map_err(|e| failure(e, shown))?;
    let result = unpack_into(archive, &staging, shown).and_then(|explicit| {
        check_merge(&staging, dir, Path::new(""), shown)?;
        merge(&staging, dir, Path::new(""), &explicit).map_err(|e| failure(e, shown))
    });
    let _ = fs::remove_dir_all(&staging);
    result
}

/// A new, empty directory inside `dir` for an archive's entries.
fn staging_dir(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    for attempt in 0u32.. {
        let staging = dir.join(format!(".space-upload-{}-{nanos:x}-{attempt}", std::process::id()));
        match fs::create_dir(&staging) {
            Err(err) if err.kind() == ErrorKind::AlreadyExists && attempt < 64 => continue,
            made => return made.map(|()| staging),
        }
    }
    unreachable!("the loop returns")
}

/// Unpacks every entry into `staging`; returns the directories the archive
/// names itself (their modes are the archive's; the others' stay).
fn unpack_into(
    mut archive: tar::Archive<ChunkReader>,
    staging: &Path,
    shown: &str,
) -> Result<std::collections::HashSet<std::path::PathBuf>, FileError> {
    use std::path::Component;
    let invalid = |message: String| FileError { reason: FileFailure::Invalid, message };
    archive.set_preserve_permissions(true);
    let mut explicit = std::collections::HashSet::new();
    for entry in archive.entries().map_err(|e| invalid(format!("{shown}: not a tar archive: {e}")))? {
        let mut entry = entry.map_err(|e| invalid(format!("{shown}: a broken archive: {e}")))?;
        let name = entry.path().map_err(|e| invalid(format!("{shown}: {e}")))?.into_owned();
        if name.components().any(|c| matches!(c, Component::ParentDir | Component::RootDir | Component::Prefix(_))) {
            return Err(invalid(format!("{shown}: entry {} would land outside the directory", name.display())));
        }
        let outside = || invalid(format!("{shown}: entry {} would land outside the directory", name.display()));
        // Through a link the archive made (or one that points out of it).
        let inside = entry.unpack_in(staging).map_err(|e| match e.to_string().contains("outside of destination") {
            true => outside(),
            false => failure(e, shown),
        })?;
        if !inside {
            return Err(outside());
        }
        if entry.header().entry_type().is_dir() {
            explicit.insert(name.components().filter(|c| matches!(c, Component::Normal(_))).collect());
        }
    }
    Ok(explicit)
}

/// Refuses, before anything moves, an archive that would put a directory
/// where `dir` has something else (a file, a link), or the reverse.
fn check_merge(staged: &Path, dir: &Path, relative: &Path, shown: &str) -> Result<(), FileError> {
    let wrong = |message: String| FileError { reason: FileFailure::WrongType, message };
    for entry in fs::read_dir(staged.join(relative)).map_err(|e| failure(e, shown))? {
        let entry = entry.map_err(|e| failure(e, shown))?;
        let name = relative.join(entry.file_name());
        let is_dir = entry.file_type().map_err(|e| failure(e, shown))?.is_dir();
        let Ok(there) = fs::symlink_metadata(dir.join(&name)) else { continue };
        match (is_dir, there.is_dir()) {
            (true, true) => check_merge(staged, dir, &name, shown)?,
            (true, false) => {
                return Err(wrong(format!("{shown}: {} exists and is not a directory", name.display())));
            }
            (false, true) => return Err(wrong(format!("{shown}: {} is a directory", name.display()))),
            (false, false) => {}
        }
    }
    Ok(())
}

/// Moves what `staged` holds at `relative` into `dir`: a directory `dir`
/// already has is merged into (given the archive's mode if the archive
/// named it), anything else is renamed over what was there.
fn merge(
    staged: &Path,
    dir: &Path,
    relative: &Path,
    explicit: &std::collections::HashSet<std::path::PathBuf>,
) -> std::io::Result<()> {
    for entry in fs::read_dir(staged.join(relative))? {
        let entry = entry?;
        let name = relative.join(entry.file_name());
        let (from, to) = (staged.join(&name), dir.join(&name));
        let is_dir = entry.file_type()?.is_dir();
        if is_dir && fs::symlink_metadata(&to).is_ok_and(|m| m.is_dir()) {
            if explicit.contains(&name) {
                fs::set_permissions(&to, entry.metadata()?.permissions())?;
            }
            merge(staged, dir, &name, explicit)?;
            continue;
        }
        match fs::rename(&from, &to) {
            // A mount point inside `dir` (`/tmp` under `/`): copied instead.
            Err(err) if err.raw_os_error() == Some(nix::libc::EXDEV) => copy_across(&from, &to, is_dir)?,
            moved => moved?,
        }
    }
    Ok(())
}

/// What a rename cannot move across mounts, copied: a directory (made,
/// then filled), a symlink (made again) or a file (its bytes and mode).
fn copy_across(from: &Path, to: &Path, is_dir: bool) -> std::io::Result<()> {
    let meta = fs::symlink_metadata(from)?;
    if is_dir {
        fs::create_dir(to)?;
        fs::set_permissions(to, meta.permissions())?;
        for entry in fs::read_dir(from)? {
            let entry = entry?;
            copy_across(&entry.path(), &to.join(entry.file_name()), entry.file_type()?.is_dir())?;
        }
        return Ok(());
    }
    if fs::symlink_metadata(to).is_ok() {
        fs::remove_file(to)?;
    }
    if meta.file_type().is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(from)?, to)
    } else {
        fs::copy(from, to).map(drop)
    }
}

/// The uid and gid of the account a request names as the owner of what it
/// makes (`None`: root's, nothing to change).
fn owner_ids(owner: Option<&str>, shown: &str) -> Result<Option<(u32, u32)>, FileError> {
    let Some(owner) = owner else { return Ok(None) };
    let account = crate::users::resolve(Some(owner))
        .map_err(|message| FileError { reason: FileFailure::Invalid, message: format!("{shown}: {message}") })?;
    Ok(Some((account.uid, account.gid)))
}

/// Makes `dir` and its missing parents, giving those it makes to `owner`.
fn make_dirs(dir: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    let missing: Vec<std::path::PathBuf> =
        dir.ancestors().take_while(|a| fs::symlink_metadata(a).is_err()).map(Path::to_path_buf).collect();
    fs::create_dir_all(dir)?;
    if let Some((uid, gid)) = owner {
        for made in missing.iter().rev() {
            std::os::unix::fs::lchown(made, Some(uid), Some(gid))?;
        }
    }
    Ok(())
}

/// Opens `path` for a write in place: truncated if it is there (keeping
/// its owner and mode), else made with `mode` and given to `owner`.
fn open_in_place(path: &Path, mode: u32, owner: Option<(u32, u32)>) -> std::io::Result<File> {
    if fs::symlink_metadata(path).is_ok_and(|meta| meta.is_dir()) {
        return Err(std::io::Error::from(ErrorKind::IsADirectory));
    }
    match OpenOptions::new().write(true).create_new(true).mode(mode).open(path) {
        Ok(file) => {
            // One change of attributes at most (a watcher sees each): the
            // mode only if the umask took something off.
            if file.metadata()?.mode() & 0o7777 != mode {
                file.set_permissions(fs::Permissions::from_mode(mode))?;
            }
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::fchown(&file, Some(uid), Some(gid))?;
            }
            Ok(file)
        }
        Err(err) if err.kind() == ErrorKind::AlreadyExists => OpenOptions::new().write(true).truncate(true).open(path),
        Err(err) => Err(err),
    }
}

/// Where an upload's bytes go.
pub enum Sink {
    File(Staged),
    /// A file written where it is ([`FileRequest::in_place`]).
    InPlace(File),
    /// A tar archive being unpacked by a worker; it reports when done.
    Unpack {
        chunks: std::sync::mpsc::Sender<Vec<u8>>,
        done: std::sync::mpsc::Receiver<Result<(), FileError>>,
    },
}

/// Opens a file (or, for a tar, starts unpacking into a directory); its
/// data follows on the stream.
pub fn begin_write(stream: u32, request: FileRequest, uploads: &Uploads) {
    if request.tar {
        let opened = absolute(&request.path).and_then(|dir| {
            // The directories this upload makes, removed again if it is refused.
            let made = dir.ancestors().take_while(|a| fs::symlink_metadata(a).is_err()).last().map(Path::to_path_buf);
            fs::create_dir_all(dir).map_err(|e| failure(e, &request.path))?;
            let (chunks, incoming) = std::sync::mpsc::channel();
            let (report, done) = std::sync::mpsc::channel();
            let dir = dir.to_path_buf();
            let shown = request.path.clone();
            pool::run(move || {
                let archive = tar::Archive::new(ChunkReader { chunks: incoming, current: Default::default() });
                let unpacked = unpack(archive, &dir, &shown);
                if let (Err(_), Some(made)) = (&unpacked, made) {
                    // Only what is still empty: nothing else wrote there meanwhile.
                    for made in dir.ancestors().take_while(|a| a.starts_with(&made)) {
                        let _ = fs::remove_dir(made);
                    }
                }
                let _ = report.send(unpacked);
            });
            Ok(Sink::Unpack { chunks, done })
        });
        uploads.lock().unwrap_or_else(|e| e.into_inner()).insert(stream, opened);
        return;
    }
    let opened = (|| {
        let path = absolute(&request.path)?;
        let owner = owner_ids(request.owner.as_deref(), &request.path)?;
        if let Some(parent) = path.parent() {
            make_dirs(parent, owner).map_err(|e| failure(e, &request.path))?;
        }
        let mode = request.mode.unwrap_or(0o644) & 0o7777;
        if request.in_place {
            return open_in_place(path, mode, owner).map(Sink::InPlace).map_err(|e| failure(e, &request.path));
        }
        let mut staged = Staged::open(path, mode).map_err(|e| failure(e, &request.path))?;
        staged.owner = owner;
        Ok(Sink::File(staged))
    })();
    uploads.lock().unwrap_or_else(|e| e.into_inner()).insert(stream, opened);
}

/// A file being written: its bytes go to a new file beside `path`, renamed
/// over it once all are in and synced, so whoever reads `path` (or a
/// host killed mid-write) finds the old file or the new one, never part of
/// one. Dropped before [`Staged::commit`], the new file goes.
pub struct Staged {
    file: File,
    temp: std::path::PathBuf,
    path: std::path::PathBuf,
    done: bool,
    /// Given the file if it is new (a file replaced keeps its owner).
    owner: Option<(u32, u32)>,
    replaces: bool,
}

impl Staged {
    fn open(path: &Path, mode: u32) -> std::io::Result<Staged> {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(std::io::Error::from(ErrorKind::InvalidInput));
        };
        // What stands at `path` is replaced, never written through: a
        // directory there is refused as writing into it was.
        let existing = fs::symlink_metadata(path).ok();
        if existing.as_ref().is_some_and(|meta| meta.is_dir()) {
            return Err(std::io::Error::from(ErrorKind::IsADirectory));
        }
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        for attempt in 0u32.. {
            let temp = dir.join(format!(
                ".{}.space-write-{}-{nanos:x}-{attempt}",
                name.to_string_lossy().chars().take(64).collect::<String>(),
                std::process::id()
            ));
            let opened = OpenOptions::new().write(true).create_new(true).mode(mode).open(&temp);
            let file = match opened {
                Err(err) if err.kind() == ErrorKind::AlreadyExists && attempt < 64 => continue,
                opened => opened?,
            };
            let replaces = existing.as_ref().is_some_and(|meta| meta.is_file());
            let staged = Staged { file, temp, path: path.to_path_buf(), done: false, owner: None, replaces };
            // The mode given wins over the umask; a file replaced keeps
            // its owner.
            staged.file.set_permissions(fs::Permissions::from_mode(mode))?;
            if let Some(meta) = existing.filter(|meta| meta.is_file()) {
                std::os::unix::fs::fchown(&staged.file, Some(meta.uid()), Some(meta.gid()))?;
                // A chown clears setuid and setgid bits: the mode again.
                staged.file.set_permissions(fs::Permissions::from_mode(mode))?;
            }
            return Ok(staged);
        }
        unreachable!("the loop returns")
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_all(bytes)
    }

    /// Syncs the new file and renames it over `path`.
    fn commit(mut self) -> std::io::Result<()> {
        if let (Some((uid, gid)), false) = (self.owner, self.replaces) {
            let mode = self.file.metadata()?.permissions();
            std::os::unix::fs::fchown(&self.file, Some(uid), Some(gid))?;
            self.file.set_permissions(mode)?;
        }
        self.file.sync_all()?;
        fs::rename(&self.temp, &self.path)?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_file(&self.temp);
        }
    }
}

/// Appends data to a file being written; a failure is kept for the end.
pub fn write_data(stream: u32, bytes: &[u8], uploads: &Uploads) {
    let mut uploads = uploads.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(entry) = uploads.get_mut(&stream) {
        let failed = match entry {
            Ok(Sink::File(file)) => file.write_all(bytes).err().map(|err| failure(err, "write")),
            Ok(Sink::InPlace(file)) => file.write_all(bytes).err().map(|err| failure(err, "write")),
            // If the unpacking stopped, `end_write` reports why.
            Ok(Sink::Unpack { chunks, .. }) => {
                let _ = chunks.send(bytes.to_vec());
                None
            }
            Err(_) => None,
        };
        if let Some(error) = failed {
            *entry = Err(error);
        }
    }
}

/// Finishes a write and reports how it went.
pub fn end_write(stream: u32, uploads: &Uploads, outbox: &SyncSender<Frame>) {
    let entry = uploads.lock().unwrap_or_else(|e| e.into_inner()).remove(&stream);
    let frame = match entry {
        Some(Ok(Sink::File(staged))) => {
            let shown = staged.path.to_string_lossy().into_owned();
            match staged.commit() {
                Ok(()) => Frame::new(stream, FrameKind::FileDone, Vec::new()),
                Err(err) => Frame::message(stream, FrameKind::FileFailed, &failure(err, &shown)),
            }
        }
        Some(Ok(Sink::InPlace(file))) => {
            drop(file);
            Frame::new(stream, FrameKind::FileDone, Vec::new())
        }
        Some(Ok(Sink::Unpack { chunks, done })) => {
            drop(chunks); // end of the archive
            match done.recv() {
                Ok(Ok(())) => Frame::new(stream, FrameKind::FileDone, Vec::new()),
                Ok(Err(error)) => Frame::message(stream, FrameKind::FileFailed, &error),
                Err(_) => Frame::message(
                    stream,
                    FrameKind::FileFailed,
                    &FileError { reason: FileFailure::Io, message: "the unpacking stopped".into() },
                ),
            }
        }
        Some(Err(error)) => Frame::message(stream, FrameKind::FileFailed, &error),
        None => Frame::message(
            stream,
            FrameKind::FileFailed,
            &FileError { reason: FileFailure::Invalid, message: "no write in progress".into() },
        ),
    };
    let _ = outbox.send(frame);
}

/// Deletes a path (a directory only when empty, or with `recursive`).
pub fn delete(stream: u32, request: FileRequest, outbox: &SyncSender<Frame>) {
    let outbox = outbox.clone();
    pool::run(move || {
        let result = (|| {
            let path = absolute(&request.path)?;
            if path == Path::new("/") {
                return Err(FileError { reason: FileFailure::Invalid, message: "refusing to delete /".into() });
            }
            let meta = fs::symlink_metadata(path).map_err(|e| failure(e, &request.path))?;
            let removed = match (meta.is_dir(), request.recursive) {
                (true, true) => fs::remove_dir_all(path),
                (true, false) => fs::remove_dir(path),
                (false, _) => fs::remove_file(path),
            };
            removed.map_err(|e| failure(e, &request.path))
        })();
        let frame = match result {
            Ok(()) => Frame::new(stream, FrameKind::FileDone, Vec::new()),
            Err(error) => Frame::message(stream, FrameKind::FileFailed, &error),
        };
        let _ = outbox.send(frame);
    });
}

/// `file`, `dir`, `symlink` or `other`, of the path itself.
fn kind_of(meta: &fs::Metadata) -> &'static str {
    if meta.file_type().is_symlink() {
        "symlink"
    } else if meta.is_dir() {
        "dir"
    } else if meta.is_file() {
        "file"
    } else {
        "other"
    }
}

/// What `ls -l` shows of `path` (a symlink itself, with its target).
pub fn describe(path: &Path) -> std::io::Result<PathInfo> {
    let meta = fs::symlink_metadata(path)?;
    let target = meta.file_type().is_symlink().then(|| fs::read_link(path).ok()).flatten();
    Ok(PathInfo {
        name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "/".into()),
        kind: kind_of(&meta).into(),
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        mtime: meta.mtime(),
        owner: crate::users::user_name(meta.uid()),
        group: crate::users::group_name(meta.gid()),
        target: target.map(|t| t.to_string_lossy().into_owned()),
    })
}

/// Stats a path, makes a directory (with its parents) or moves a path;
/// answers with the path's [`PathInfo`] (the destination's, for a move).
pub fn path_op(stream: u32, request: PathRequest, outbox: &SyncSender<Frame>) {
    let outbox = outbox.clone();
    pool::run(move || {
        let result = (|| {
            let path = absolute(&request.path)?;
            let at = |e| failure(e, &request.path);
            match request.op {
                PathOpKind::Stat => describe(path).map_err(at),
                PathOpKind::Mkdir => {
                    match fs::symlink_metadata(path) {
                        Ok(meta) if meta.is_dir() => {
                            return Err(FileError {
                                reason: FileFailure::Exists,
                                message: format!("{}: the directory exists", request.path),
                            })
                        }
                        Ok(_) => {
                            return Err(FileError {
                                reason: FileFailure::WrongType,
                                message: format!("{}: exists and is not a directory", request.path),
                            })
                        }
                        Err(_) => {}
                    }
                    let owner = owner_ids(request.owner.as_deref(), &request.path)?;
                    make_dirs(path, owner).map_err(at)?;
                    describe(path).map_err(at)
                }
                PathOpKind::Move => {
                    let to = request.to.as_deref().unwrap_or_default();
                    let to_path = absolute(to)?;
                    fs::rename(path, to_path).map_err(at)?;
                    describe(to_path).map_err(|e| failure(e, to))
                }
            }
        })();
        let frame = match result {
            Ok(info) => Frame::message(stream, FrameKind::PathInfo, &info),
            Err(error) => Frame::message(stream, FrameKind::FileFailed, &error),
        };
        let _ = outbox.send(frame);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("space-agent-files-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn request(path: &Path) -> FileRequest {
        FileRequest { path: path.to_string_lossy().into_owned(), mode: Some(0o600), ..FileRequest::default() }
    }

    /// A write lands whole or not at all: until its end the old file is
    /// what a reader sees, and a write never ended leaves nothing behind.
    #[test]
    fn a_write_replaces_the_file_by_rename_and_an_unfinished_one_leaves_it() {
        let dir = scratch("atomic");
        let target = dir.join("notes.txt");
        fs::write(&target, "old").unwrap();
        let uploads = Uploads::default();
        let (outbox, answers) = std::sync::mpsc::sync_channel(8);

        begin_write(1, request(&target), &uploads);
        write_data(1, b"new bytes", &uploads);
        assert_eq!(fs::read_to_string(&target).unwrap(), "old", "nothing in place before the end");
        end_write(1, &uploads, &outbox);
        assert_eq!(answers.recv().unwrap().kind, FrameKind::FileDone);
        assert_eq!(fs::read_to_string(&target).unwrap(), "new bytes");
        assert_eq!(fs::metadata(&target).unwrap().permissions().mode() & 0o7777, 0o600);

        begin_write(2, request(&target), &uploads);
        write_data(2, b"half of a", &uploads);
        uploads.lock().unwrap().clear();
        assert_eq!(fs::read_to_string(&target).unwrap(), "new bytes");
        let names: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["notes.txt"], "no temporary file is left");

        // A link at the path is replaced, its target untouched.
        let elsewhere = dir.join("elsewhere");
        fs::write(&elsewhere, "keep").unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        begin_write(3, request(&link), &uploads);
        write_data(3, b"written", &uploads);
        end_write(3, &uploads, &outbox);
        assert_eq!(answers.recv().unwrap().kind, FrameKind::FileDone);
        assert_eq!(fs::read_to_string(&elsewhere).unwrap(), "keep");
        assert!(fs::symlink_metadata(&link).unwrap().is_file());
        fs::remove_dir_all(&dir).unwrap();
    }

    /// In place: the file itself is truncated and written (its inode and
    /// owner stay); a new one, and the directories made for it, go to the
    /// owner asked for.
    #[test]
    fn a_write_in_place_keeps_the_file_and_gives_what_it_makes_to_its_owner() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: giving files to another account needs root");
            return;
        }
        let dir = scratch("in-place");
        let nobody = crate::users::resolve(Some("nobody")).expect("the host has `nobody`");
        let uploads = Uploads::default();
        let (outbox, answers) = std::sync::mpsc::sync_channel(8);
        let made = dir.join("made/deeper/new.txt");
        let in_place = |path: &Path| FileRequest {
            owner: Some("nobody".into()),
            in_place: true,
            mode: Some(0o644),
            ..request(path)
        };

        begin_write(1, in_place(&made), &uploads);
        write_data(1, b"fresh", &uploads);
        end_write(1, &uploads, &outbox);
        assert_eq!(answers.recv().unwrap().kind, FrameKind::FileDone);
        for path in [made.clone(), dir.join("made/deeper"), dir.join("made")] {
            let meta = fs::metadata(&path).unwrap();
            assert_eq!((meta.uid(), meta.gid()), (nobody.uid, nobody.gid), "{}", path.display());
        }
        assert_eq!(fs::metadata(&dir).unwrap().uid(), 0, "what was there keeps its owner");
        assert_eq!(fs::metadata(&made).unwrap().mode() & 0o7777, 0o644);

        let existing = dir.join("existing.txt");
        fs::write(&existing, "a longer old content").unwrap();
        let inode = fs::metadata(&existing).unwrap().ino();
        begin_write(2, in_place(&existing), &uploads);
        write_data(2, b"short", &uploads);
        end_write(2, &uploads, &outbox);
        assert_eq!(answers.recv().unwrap().kind, FrameKind::FileDone);
        let meta = fs::metadata(&existing).unwrap();
        assert_eq!((fs::read_to_string(&existing).unwrap().as_str(), meta.ino(), meta.uid()), ("short", inode, 0));

        begin_write(3, in_place(&dir.join("made")), &uploads);
        end_write(3, &uploads, &outbox);
        assert_eq!(answers.recv().unwrap().kind, FrameKind::FileFailed, "a directory is not written over");
        fs::remove_dir_all(&dir).unwrap();
    }
}
