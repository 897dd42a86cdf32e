//! Following a command's transcript: what was written, then (when asked)
//! what comes, then the exit once the command has ended. The `/v1` output
//! routes and E2B's process streams both read a command this way.

use std::sync::Arc;

use base64::Engine as _;
use space_api::{ErrorCode, OutputFrame, ProcessResult};
use tokio::sync::{mpsc, watch};

use crate::error::NodeError;
use crate::platform::Platform;
use crate::transcript::{self, Chunk, Progress, Stream, TranscriptReader};

/// What a follower hands on: output as it was written, then the end.
pub enum Emitted {
    Chunk(Chunk),
    Exit(ProcessResult),
}

impl Emitted {
    pub fn into_frame(self) -> OutputFrame {
        match self {
            Emitted::Chunk(chunk) => chunk_frame(chunk),
            Emitted::Exit(result) => OutputFrame::Exit { result },
        }
    }
}

/// Starts following a command's transcript from `from`: everything there
/// is, then (with `follow`) what comes, then the exit once it has ended.
pub fn follow(
    platform: &Arc<Platform>,
    id: &str,
    cid: &str,
    from: u64,
    follow: bool,
) -> Result<mpsc::Receiver<Emitted>, NodeError> {
    platform.sandbox(id)?;
    platform.command_of(id, cid)?;
    let live = platform.live_command(cid).map(|(progress, _, _)| progress);
    let path = transcript::path_for(&platform.data.sandbox_state_dir(id), cid);
    let reader = TranscriptReader::open(&path)
        .map_err(|_| NodeError::new(ErrorCode::NotFound, "the transcript is gone (the sandbox was deleted)"))?;
    let (tx, rx) = mpsc::channel::<Emitted>(16);
    let follower = Follower {
        platform: platform.clone(),
        sandbox_id: id.to_string(),
        command_id: cid.to_string(),
        path,
        reader,
        live,
        tx,
    };
    tokio::spawn(follower.run(from, follow));
    Ok(rx)
}

struct Follower {
    platform: Arc<Platform>,
    sandbox_id: String,
    command_id: String,
    path: std::path::PathBuf,
    reader: TranscriptReader,
    live: Option<watch::Receiver<Progress>>,
    tx: mpsc::Sender<Emitted>,
}

impl Follower {
    /// What the writer has completed; a finished command's file is whole.
    fn progress(&mut self) -> Progress {
        match &mut self.live {
            Some(live) => *live.borrow_and_update(),
            None => Progress { file_len: std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0), finished: true },
        }
    }

    async fn run(mut self, from: u64, follow: bool) {
        let first = self.progress();
        if self.reader.seek_to(from, first.file_len).is_err() {
            return;
        }
        loop {
            let progress = self.progress();
            loop {
                match self.reader.next_chunk(progress.file_len) {
                    Ok(Some(chunk)) => {
                        if !self.send(Emitted::Chunk(chunk)).await {
                            return; // the client went away
                        }
                    }
                    Ok(None) => break,
                    Err(err) => {
                        tracing::error!(command = %self.command_id, "reading the transcript: {err}");
                        return;
                    }
                }
            }
            if progress.finished {
                let command = self.platform.command_of(&self.sandbox_id, &self.command_id);
                if let Some(result) = command.ok().and_then(|c| c.result) {
                    self.send(Emitted::Exit(result)).await;
                }
                return;
            }
            if !follow {
                // The result is stored before the transcript is marked
                // finished, so a stored result means the file is whole.
                let ended =
                    self.platform.command_of(&self.sandbox_id, &self.command_id).is_ok_and(|c| c.result.is_some());
                if ended && self.live.is_some() {
                    self.live = None;
                    continue;
                }
                return;
            }
            let Some(live) = self.live.as_mut() else {
                continue;
            };
            if live.changed().await.is_err() {
                // The writer is gone: the command ended; read the rest as a file.
                self.live = None;
            }
        }
    }

    async fn send(&self, item: Emitted) -> bool {
        self.tx.send(item).await.is_ok()
    }
}

fn chunk_frame(chunk: Chunk) -> OutputFrame {
    let (data, data_b64) = match String::from_utf8(chunk.bytes) {
        Ok(text) => (Some(text), None),
        Err(err) => (None, Some(base64::engine::general_purpose::STANDARD.encode(err.into_bytes()))),
    };
    match chunk.stream {
        Stream::Stdout => OutputFrame::Stdout { offset: chunk.offset, data, data_b64 },
        Stream::Stderr => OutputFrame::Stderr { offset: chunk.offset, data, data_b64 },
    }
}
