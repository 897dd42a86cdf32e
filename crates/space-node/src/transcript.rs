//! A command's output, kept on the host's disk so any client can re-read it
//! from any offset while the sandbox exists.
//!
//! The file is a sequence of records `[stream: u8][len: u32 LE][bytes]` in
//! arrival order. Offsets in the API count output bytes of both streams
//! together (the combined output), so one number says where to resume.
//! The writer publishes how many file bytes are complete; readers never read
//! past that, so they never see half a record.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use space_host::datadir::DiskSpace;
use tokio::sync::watch;

const RECORD_HEADER: usize = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout = 1,
    Stderr = 2,
}

/// What the writer has made durable so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// File bytes of complete records.
    pub file_len: u64,
    /// The command ended and nothing more will be written.
    pub finished: bool,
}

/// How much output may be kept; what comes past a bound is counted only.
#[derive(Clone)]
pub struct OutputLimits {
    /// Output bytes kept per command.
    pub per_command: u64,
    /// File bytes of all the sandbox's transcripts (shared by its writers)
    /// and their bound.
    pub sandbox: Option<(Arc<AtomicU64>, u64)>,
    /// The data dir's space and the free space it keeps: under it, nothing
    /// more is kept (checked every [`HOST_CHECK_BYTES`]).
    pub host: Option<(DiskSpace, u64)>,
}

/// How often (in output bytes) a writer looks at the host's free space.
pub const HOST_CHECK_BYTES: u64 = 1 << 20;

/// Which bound output first went past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    Command,
    Sandbox,
    Host,
}

pub struct TranscriptWriter {
    file: File,
    progress: watch::Sender<Progress>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    buf: Vec<u8>,
    limits: OutputLimits,
    /// Output bytes offered when the host's free space is next looked at.
    next_host_check: u64,
    host_low: bool,
    /// Output bytes not kept, and the bound that first stopped them.
    pub dropped_bytes: u64,
    pub dropped: Option<Dropped>,
}

impl TranscriptWriter {
    pub fn create(path: &Path) -> io::Result<TranscriptWriter> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let file = OpenOptions::new().create_new(true).append(true).open(path)?;
        Ok(TranscriptWriter {
            file,
            progress: watch::Sender::new(Progress::default()),
            stdout_bytes: 0,
            stderr_bytes: 0,
            buf: Vec::new(),
            limits: OutputLimits::unlimited(),
            next_host_check: 0,
            host_low: false,
            dropped_bytes: 0,
            dropped: None,
        })
    }

    /// Keeps output only within `limits`.
    pub fn with_limits(mut self, limits: OutputLimits) -> TranscriptWriter {
        self.limits = limits;
        self
    }

    /// Opens an existing transcript to append to it (a command picked up
    /// again after a server restart), recounting what it already holds.
    pub fn reopen(path: &Path) -> io::Result<TranscriptWriter> {
        let file_len = std::fs::metadata(path)?.len();
        let mut reader = TranscriptReader::open(path)?;
        let (mut stdout_bytes, mut stderr_bytes, mut complete) = (0, 0, 0);
        while let Some(chunk) = reader.next_chunk(file_len)? {
            match chunk.stream {
                Stream::Stdout => stdout_bytes += chunk.bytes.len() as u64,
                Stream::Stderr => stderr_bytes += chunk.bytes.len() as u64,
            }
            complete = reader.file_pos;
        }
        let file = OpenOptions::new().write(true).open(path)?;
        // A record cut short by a crash is dropped.
        file.set_len(complete)?;
        let file = OpenOptions::new().append(true).open(path)?;
        Ok(TranscriptWriter {
            file,
            progress: watch::Sender::new(Progress { file_len: complete, finished: false }),
            stdout_bytes,
            stderr_bytes,
            buf: Vec::new(),
            limits: OutputLimits::unlimited(),
            next_host_check: 0,
            host_low: false,
            dropped_bytes: 0,
            dropped: None,
        })
    }

    /// Where readers learn about new output.
    pub fn subscribe(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    pub fn append(&mut self, stream: Stream, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        if let Some(bound) = self.over_a_bound(bytes.len() as u64) {
            self.dropped_bytes += bytes.len() as u64;
            self.dropped.get_or_insert(bound);
            return Ok(());
        }
        self.buf.clear();
        self.buf.push(stream as u8);
        self.buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(bytes);
        self.file.write_all(&self.buf)?;
        match stream {
            Stream::Stdout => self.stdout_bytes += bytes.len() as u64,
            Stream::Stderr => self.stderr_bytes += bytes.len() as u64,
        }
        let added = self.buf.len() as u64;
        self.progress.send_modify(|p| p.file_len += added);
        Ok(())
    }

    /// The bound that keeps `len` more output bytes out, if any; when none
    /// does, the sandbox's count already includes them.
    fn over_a_bound(&mut self, len: u64) -> Option<Dropped> {
        let offered = self.stdout_bytes + self.stderr_bytes + self.dropped_bytes;
        if let Some((space, reserve)) = &self.limits.host {
            if offered >= self.next_host_check {
                self.next_host_check = offered + HOST_CHECK_BYTES;
                self.host_low = match space.free_and_total() {
                    (0, 0) => false,
                    (free, _) => free < *reserve,
                };
            }
        }
        if self.stdout_bytes + self.stderr_bytes + len > self.limits.per_command {
            return Some(Dropped::Command);
        }
        if self.host_low {
            return Some(Dropped::Host);
        }
        if let Some((used, max)) = &self.limits.sandbox {
            let record = RECORD_HEADER as u64 + len;
            if used.fetch_add(record, Ordering::Relaxed) + record > *max {
                used.fetch_sub(record, Ordering::Relaxed);
                return Some(Dropped::Sandbox);
            }
        }
        None
    }

    /// What the command's result says about output that was not kept.
    pub fn dropped_note(&self) -> Option<String> {
        let n = self.dropped_bytes;
        Some(match self.dropped? {
            Dropped::Command => {
                format!("{n} bytes of output past the {}-byte limit per command were not kept", self.limits.per_command)
            }
            Dropped::Sandbox => format!(
                "{n} bytes of output were not kept: the sandbox's commands reached its {}-byte output limit",
                self.limits.sandbox.as_ref().map(|(_, max)| *max).unwrap_or(0)
            ),
            Dropped::Host => format!("{n} bytes of output were not kept: the host is low on disk"),
        })
    }

    pub fn finish(&mut self) {
        let _ = self.file.sync_data();
        self.progress.send_modify(|p| p.finished = true);
    }
}

impl OutputLimits {
    pub fn unlimited() -> OutputLimits {
        OutputLimits { per_command: u64::MAX, sandbox: None, host: None }
    }
}

/// One piece of output read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub stream: Stream,
    /// Offset of `bytes[0]` in the combined output.
    pub offset: u64,
    pub bytes: Vec<u8>,
}

pub struct TranscriptReader {
    file: File,
    /// File position of the next record header.
    file_pos: u64,
    /// Combined-output offset at `file_pos`.
    offset: u64,
    /// Bytes to skip in the next record (when `from` fell inside it).
    skip: u64,
}

impl TranscriptReader {
    pub fn open(path: &Path) -> io::Result<TranscriptReader> {
        Ok(TranscriptReader { file: File::open(path)?, file_pos: 0, offset: 0, skip: 0 })
    }

    /// Positions the reader at combined offset `from`, within the first
    /// `limit` file bytes; an offset past the end waits there for more.
    pub fn seek_to(&mut self, from: u64, limit: u64) -> io::Result<()> {
        while self.file_pos + RECORD_HEADER as u64 <= limit {
            let (_, len) = self.header_at(self.file_pos)?;
            if self.offset + len > from {
                self.skip = from - self.offset;
                return Ok(());
            }
            self.file_pos += RECORD_HEADER as u64 + len;
            self.offset += len;
        }
        self.skip = from.saturating_sub(self.offset);
        Ok(())
    }

    fn header_at(&mut self, pos: u64) -> io::Result<(Stream, u64)> {
        let mut header = [0u8; RECORD_HEADER];
        self.file.seek(SeekFrom::Start(pos))?;
        self.file.read_exact(&mut header)?;
        let stream = match header[0] {
            1 => Stream::Stdout,
            2 => Stream::Stderr,
            other => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad record kind {other}"))),
        };
        Ok((stream, u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as u64))
    }

    /// The next chunk among the first `limit` file bytes, if any.
    pub fn next_chunk(&mut self, limit: u64) -> io::Result<Option<Chunk>> {
        loop {
            if self.file_pos + RECORD_HEADER as u64 > limit {
                return Ok(None);
            }
            let (stream, len) = self.header_at(self.file_pos)?;
            let record_start = self.offset;
            self.file_pos += RECORD_HEADER as u64 + len;
            self.offset += len;
            if self.skip >= len {
                self.skip -= len;
                continue;
            }
            let skip = std::mem::take(&mut self.skip);
            self.file.seek(SeekFrom::Current(skip as i64))?;
            let mut bytes = vec![0u8; (len - skip) as usize];
            self.file.read_exact(&mut bytes)?;
            return Ok(Some(Chunk { stream, offset: record_start + skip, bytes }));
        }
    }
}

/// Where a command's transcript lives, in its sandbox's state dir
/// ([`DataDir::sandbox_state_dir`](space_host::datadir::DataDir::sandbox_state_dir)).
pub fn path_for(sandbox_state_dir: &Path, command_id: &str) -> PathBuf {
    sandbox_state_dir.join("commands").join(command_id).join("transcript")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(path: &Path, from: u64) -> Vec<Chunk> {
        let limit = std::fs::metadata(path).unwrap().len();
        let mut reader = TranscriptReader::open(path).unwrap();
        reader.seek_to(from, limit).unwrap();
        std::iter::from_fn(|| reader.next_chunk(limit).unwrap()).collect()
    }

    #[test]
    fn output_past_the_limit_is_counted_not_kept() {
        let path = std::env::temp_dir().join(format!("space-limit-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let limits = OutputLimits { per_command: 10, ..OutputLimits::unlimited() };
        let mut writer = TranscriptWriter::create(&path).unwrap().with_limits(limits);
        writer.append(Stream::Stdout, b"12345").unwrap();
        writer.append(Stream::Stderr, b"678").unwrap();
        writer.append(Stream::Stdout, b"9abc").unwrap();
        writer.append(Stream::Stdout, b"de").unwrap();
        assert_eq!((writer.stdout_bytes, writer.stderr_bytes, writer.dropped_bytes), (7, 3, 4));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 10 + 3 * RECORD_HEADER as u64);
        assert_eq!(writer.dropped, Some(Dropped::Command));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_sandboxs_writers_share_one_bound() {
        let dir = std::env::temp_dir().join(format!("space-sandbox-limit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let used = Arc::new(AtomicU64::new(0));
        let limits = OutputLimits { sandbox: Some((used.clone(), 40)), ..OutputLimits::unlimited() };
        let mut one = TranscriptWriter::create(&dir.join("1")).unwrap().with_limits(limits.clone());
        let mut two = TranscriptWriter::create(&dir.join("2")).unwrap().with_limits(limits);
        one.append(Stream::Stdout, &[b'a'; 15]).unwrap();
        two.append(Stream::Stdout, &[b'b'; 15]).unwrap();
        // 2 × (5 + 15) = 40 file bytes: the bound is reached exactly.
        assert_eq!(used.load(Ordering::Relaxed), 40);
        one.append(Stream::Stderr, b"x").unwrap();
        assert_eq!((one.dropped, one.dropped_bytes), (Some(Dropped::Sandbox), 1));
        assert!(one.dropped_note().unwrap().contains("40-byte output limit"), "{:?}", one.dropped_note());
        let on_disk = std::fs::metadata(dir.join("1")).unwrap().len() + std::fs::metadata(dir.join("2")).unwrap().len();
        assert_eq!(on_disk, 40);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn nothing_is_kept_under_the_hosts_reserve() {
        let dir = std::env::temp_dir().join(format!("space-host-limit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let limits = OutputLimits { host: Some((DiskSpace::of(&dir), u64::MAX)), ..OutputLimits::unlimited() };
        let mut writer = TranscriptWriter::create(&dir.join("t")).unwrap().with_limits(limits);
        writer.append(Stream::Stdout, b"hello").unwrap();
        assert_eq!((writer.dropped, writer.dropped_bytes), (Some(Dropped::Host), 5));
        assert_eq!(std::fs::metadata(dir.join("t")).unwrap().len(), 0);
        let limits = OutputLimits { host: Some((DiskSpace::of(&dir), 0)), ..OutputLimits::unlimited() };
        let mut writer = TranscriptWriter::create(&dir.join("u")).unwrap().with_limits(limits);
        writer.append(Stream::Stdout, b"hello").unwrap();
        assert_eq!(writer.dropped, None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn replays_from_any_offset() {
        let dir = std::env::temp_dir().join(format!("space-transcript-{}", std::process::id()));
        let path = dir.join("t");
        let _ = std::fs::remove_dir_all(&dir);
        let mut writer = TranscriptWriter::create(&path).unwrap();
        writer.append(Stream::Stdout, b"hello ").unwrap();
        writer.append(Stream::Stderr, b"oops\n").unwrap();
        writer.append(Stream::Stdout, b"world\n\x00\xff").unwrap();
        writer.finish();
        assert_eq!((writer.stdout_bytes, writer.stderr_bytes), (14, 5));

        let all = collect(&path, 0);
        assert_eq!(all.len(), 3);
        assert_eq!(all[1], Chunk { stream: Stream::Stderr, offset: 6, bytes: b"oops\n".to_vec() });
        let middle = collect(&path, 8);
        assert_eq!(middle[0], Chunk { stream: Stream::Stderr, offset: 8, bytes: b"ps\n".to_vec() });
        assert_eq!(middle[1].bytes, b"world\n\x00\xff");
        assert!(collect(&path, 19).is_empty());
        assert!(collect(&path, 1000).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
