//! File operations on paths inside the sandbox. Paths are resolved by this
//! (sandboxed) process, so `..` and symlinks can only ever lead to other
//! paths of the sandbox.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};

use space_proto::{
    DirEntry, FileError, FileFailure, FileInfo, FileListing, FileRequest, Frame, FrameKind, MAX_OUTPUT_CHUNK,
};

use crate::pool;

/// Files being written, by stream.
pub type Uploads = Arc<Mutex<HashMap<u32, Result<File, FileError>>>>;

fn failure(err: std::io::Error, path: &str) -> FileError {
    let reason = match err.kind() {
        ErrorKind::NotFound => FileFailure::NotFound,
        ErrorKind::PermissionDenied => FileFailure::PermissionDenied,
        ErrorKind::IsADirectory | ErrorKind::NotADirectory => FileFailure::WrongType,
        ErrorKind::DirectoryNotEmpty => FileFailure::NotEmpty,
        ErrorKind::InvalidInput => FileFailure::Invalid,
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
            if meta.is_dir() {
                let mut entries = Vec::new();
                for entry in fs::read_dir(path).map_err(|e| failure(e, &request.path))?.flatten() {
                    let Ok(meta) = entry.path().symlink_metadata() else { continue };
                    let kind = if meta.file_type().is_symlink() {
                        "symlink"
                    } else if meta.is_dir() {
                        "dir"
                    } else if meta.is_file() {
                        "file"
                    } else {
                        "other"
                    };
                    entries.push(DirEntry {
                        name: entry.file_name().to_string_lossy().into_owned(),
                        kind: kind.into(),
                        size: meta.len(),
                        mode: meta.mode() & 0o7777,
                        mtime: meta.mtime(),
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

/// Opens a file for a write; its data follows on the stream.
pub fn begin_write(stream: u32, request: FileRequest, uploads: &Uploads) {
    let opened = (|| {
        let path = absolute(&request.path)?;
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| failure(e, &request.path))?;
        }
        let mode = request.mode.unwrap_or(0o644) & 0o7777;
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(path)
            .map_err(|e| failure(e, &request.path))?;
        // The mode given wins over the umask and over an existing file's.
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(|e| failure(e, &request.path))?;
        Ok(file)
    })();
    uploads.lock().unwrap_or_else(|e| e.into_inner()).insert(stream, opened);
}

/// Appends data to a file being written; a failure is kept for the end.
pub fn write_data(stream: u32, bytes: &[u8], uploads: &Uploads) {
    let mut uploads = uploads.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(entry) = uploads.get_mut(&stream) {
        if let Ok(file) = entry {
            if let Err(err) = file.write_all(bytes) {
                *entry = Err(failure(err, "write"));
            }
        }
    }
}

/// Finishes a write and reports how it went.
pub fn end_write(stream: u32, uploads: &Uploads, outbox: &SyncSender<Frame>) {
    let entry = uploads.lock().unwrap_or_else(|e| e.into_inner()).remove(&stream);
    let frame = match entry {
        Some(Ok(file)) => match file.sync_all() {
            Ok(()) => Frame::new(stream, FrameKind::FileDone, Vec::new()),
            Err(err) => Frame::message(stream, FrameKind::FileFailed, &failure(err, "sync")),
        },
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
