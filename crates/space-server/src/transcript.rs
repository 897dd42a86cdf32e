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

pub struct TranscriptWriter {
    file: File,
    progress: watch::Sender<Progress>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    buf: Vec<u8>,
    /// Output bytes kept at most; later output is only counted.
    limit: u64,
    /// Output bytes not kept because of `limit`.
    pub dropped_bytes: u64,
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
            limit: u64::MAX,
            dropped_bytes: 0,
        })
    }

    /// Keeps at most `bytes` of output (stdout and stderr together).
    pub fn with_limit(mut self, bytes: u64) -> TranscriptWriter {
        self.limit = bytes;
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
            limit: u64::MAX,
            dropped_bytes: 0,
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
        if self.stdout_bytes + self.stderr_bytes + bytes.len() as u64 > self.limit {
            self.dropped_bytes += bytes.len() as u64;
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

    pub fn finish(&mut self) {
        let _ = self.file.sync_data();
        self.progress.send_modify(|p| p.finished = true);
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

/// Where a command's transcript lives.
pub fn path_for(sandbox_dir: &Path, command_id: &str) -> PathBuf {
    sandbox_dir.join("commands").join(command_id).join("transcript")
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
        let mut writer = TranscriptWriter::create(&path).unwrap().with_limit(10);
        writer.append(Stream::Stdout, b"12345").unwrap();
        writer.append(Stream::Stderr, b"678").unwrap();
        writer.append(Stream::Stdout, b"9abc").unwrap();
        writer.append(Stream::Stdout, b"de").unwrap();
        assert_eq!((writer.stdout_bytes, writer.stderr_bytes, writer.dropped_bytes), (7, 3, 4));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 10 + 3 * RECORD_HEADER as u64);
        std::fs::remove_file(&path).unwrap();
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
