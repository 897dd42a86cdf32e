//! Taking back the agent of a sandbox another server process ran: at a
//! restart for the sandboxes that run (`recovery.rs`), and for those it
//! found frozen, before their actor's first job that needs the agent
//! (`actor.rs`). The agent redials whenever its channel drops; the
//! handshake checks its channel key and reuses its session, so the commands
//! and code contexts it serves carry on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use space_api::Command;
use space_engine::{AgentConn, ExecStream, LiveStatus};

use crate::domain::Event;
use crate::error::NodeError;
use crate::failures::AdoptError;
use crate::platform::Platform;
use crate::store::SandboxRecord;
use crate::transcript::{self, TranscriptWriter};

/// How long a re-adopted agent has to answer its handshake.
const ADOPT_PATIENCE: Duration = Duration::from_secs(10);

/// Handshakes a redial runs at once: connections past them wait.
const MAX_PENDING_HANDSHAKES: usize = 32;

/// How long a redial waits in all for an agent whose sandbox still lives
/// (a loaded host can take far longer than [`space_engine::REDIAL_PATIENCE`]).
const REDIAL_CAP: Duration = Duration::from_secs(120);

impl Platform {
    /// Takes the sandbox's agent back: runs `handshake` on `first` (a
    /// restore's first connection) if given, then on every connection to
    /// the listening socket, several at once, until one is the sandbox's
    /// agent. Another process in the sandbox may dial in too (it does not
    /// hold the channel key, so its handshake fails), but it cannot keep the
    /// agent out: every connection is heard, the agent's among them.
    pub(crate) async fn take_agent<T, F, Fut>(
        &self,
        spec: &space_engine::SandboxSpec,
        first: Option<tokio::net::UnixStream>,
        mut handshake: F,
    ) -> Result<T, AdoptError>
    where
        F: FnMut(tokio::net::UnixStream) -> Fut,
        Fut: std::future::Future<Output = Result<T, space_engine::AgentError>>,
    {
        use futures_util::StreamExt;
        if let Some(socket) = first {
            match handshake(socket).await {
                Err(space_engine::AgentError::Impostor) => self.impostor(spec),
                other => return other.map_err(AdoptError::Handshake),
            }
        }
        let listener = self.engine.redial(spec).await.map_err(AdoptError::engine("listen for its agent"))?;
        tracing::debug!(sandbox = %spec.id, "listening for its agent");
        let began = tokio::time::Instant::now();
        let mut deadline = began + space_engine::REDIAL_PATIENCE;
        let mut pending = futures_util::stream::FuturesUnordered::new();
        let mut last_error = None;
        let mut turned_away = 0;
        loop {
            tokio::select! {
                accepted = listener.accept(), if pending.len() < MAX_PENDING_HANDSHAKES => {
                    pending.push(handshake(accepted.map_err(AdoptError::engine("accept its agent's connection"))?));
                }
                Some(result) = pending.next(), if !pending.is_empty() => match result {
                    Ok(taken) => return Ok(taken),
                    Err(space_engine::AgentError::Impostor) => {
                        turned_away += 1;
                        self.impostor(spec);
                    }
                    Err(err) => last_error = Some(err),
                },
                () = tokio::time::sleep_until(deadline), if pending.is_empty() => {
                    // Slow, not gone: wait on while its engine still runs it,
                    // first putting right what would keep its agent from
                    // dialing in (a cgroup a killed server left frozen).
                    let runs = self.still_runs(spec).await;
                    if runs && began.elapsed() < REDIAL_CAP {
                        match self.settle_running(spec).await {
                            Some(settled) => tracing::warn!(sandbox = %spec.id, "its agent is slow to dial in: {settled}"),
                            None => tracing::info!(sandbox = %spec.id, "its agent is slow to dial in; waiting on"),
                        }
                        deadline = tokio::time::Instant::now() + space_engine::REDIAL_PATIENCE;
                        continue;
                    }
                    let waited = began.elapsed();
                    return Err(match (runs, last_error) {
                        (false, _) => AdoptError::GoneWhileWaiting { waited },
                        (true, Some(error)) => AdoptError::Handshake(error),
                        (true, None) if turned_away > 0 => AdoptError::OnlyImpostors { waited, turned_away },
                        (true, None) => AdoptError::NotDialledIn { waited },
                    });
                }
            }
        }
    }

    /// Whether the engine still runs the sandbox (off the async threads).
    pub(crate) async fn still_runs(&self, spec: &space_engine::SandboxSpec) -> bool {
        self.live_status(spec).await != LiveStatus::Gone
    }

    /// What the engine shows of the sandbox (off the async threads). Read
    /// as `statuses` does: `runsc state` waits on a sandbox whose processes
    /// are stopped, as long as they are.
    async fn live_status(&self, spec: &space_engine::SandboxSpec) -> LiveStatus {
        let (engine, spec) = (self.engine.clone(), spec.clone());
        let statuses = tokio::task::spawn_blocking(move || engine.statuses(std::slice::from_ref(&spec))).await;
        statuses.ok().and_then(|statuses| statuses.first().copied()).unwrap_or(LiveStatus::Gone)
    }

    /// [`space_engine::Engine::settle_running`], off the async threads.
    async fn settle_running(&self, spec: &space_engine::SandboxSpec) -> Option<String> {
        let (engine, spec) = (self.engine.clone(), spec.clone());
        tokio::task::spawn_blocking(move || engine.settle_running(&spec)).await.ok().flatten()
    }

    fn impostor(&self, spec: &space_engine::SandboxSpec) {
        tracing::warn!(sandbox = %spec.id, "turned away a connection to the agent socket that did not hold the agent's key");
    }

    /// Fails a sandbox whose agent could not be taken back after a restart:
    /// stops what runs of it and ends its commands.
    pub(crate) async fn abandon(&self, id: &str, why: &AdoptError) {
        tracing::warn!(sandbox = %id, "could not re-adopt: {why}");
        if let Ok(record) = self.sandbox(id) {
            self.stop_engine(&self.engine_spec(&record)).await;
        }
        let reason =
            format!("the server restarted and could not re-adopt the sandbox ({why}); delete it to free its disk");
        let _ = self.apply(id, Event::Failure, Some(reason));
        let _ = self.end_lost_commands(id, "the server restarted");
    }

    /// Gives every command of the sandbox without a result one saying it
    /// was lost (`why`): nothing follows them any more.
    pub(crate) fn end_lost_commands(&self, id: &str, why: &str) -> Result<(), NodeError> {
        for command in self.unfinished_commands(id) {
            self.lose_command(command, why)?;
        }
        self.changed();
        Ok(())
    }

    /// Records that a command's end will never be known, and why.
    fn lose_command(&self, mut command: Command, why: &str) -> Result<(), NodeError> {
        command.state = space_api::CommandState::Exited;
        command.result = Some(crate::commands::lost_result(&command, why));
        Ok(self.store.node().put_command(&command)?)
    }

    fn unfinished_commands(&self, id: &str) -> Vec<Command> {
        self.store.node().commands(id).unwrap_or_default().into_iter().filter(|c| c.result.is_none()).collect()
    }

    /// Takes back the agent of a sandbox a restarted server left as it
    /// found it (frozen, or running with an agent slow to come back),
    /// before its actor's first job that needs it. Whether it is thawed
    /// for that follows what its engine shows now.
    /// `stay_thawed`: for a resume, which would thaw it right after.
    pub(crate) async fn adopt_frozen(self: &Arc<Self>, id: &str, stay_thawed: bool) -> Result<AgentConn, AdoptError> {
        let record = self.sandbox(id)?;
        let thaw = match self.live_status(&self.engine_spec(&record)).await {
            LiveStatus::Gone => return Err(AdoptError::EngineGone),
            LiveStatus::Running => Thaw::No,
            LiveStatus::Paused if stay_thawed => Thaw::ForGood,
            LiveStatus::Paused => Thaw::ForHandshake,
        };
        self.take_back(&record, thaw).await
    }

    /// Takes back the agent of a sandbox a previous server process ran, with
    /// the commands and code contexts it still serves; a frozen one is
    /// thawed (a frozen agent cannot redial), see [`Thaw`].
    pub(crate) async fn take_back(
        self: &Arc<Self>,
        record: &SandboxRecord,
        thaw: Thaw,
    ) -> Result<AgentConn, AdoptError> {
        let session = record.agent_session.ok_or(AdoptError::NoSession)?;
        let spec = self.engine_spec(record);
        let began = Instant::now();
        if thaw != Thaw::No {
            self.engine.resume(&spec).await.map_err(AdoptError::engine("thaw it"))?;
        }
        // Each running command with the agent stream and timeout it had.
        let mut resumable = Vec::new();
        for command in self.unfinished_commands(&record.sandbox.id) {
            match self.store.node().command_stream(&command.id)? {
                Some((stream, timeout_s)) => resumable.push((command, stream, timeout_s)),
                // Nothing says which stream it was: it cannot be finished.
                None => {
                    let _ = self.lose_command(command, "the server restarted");
                }
            }
        }
        let contexts = self.saved_contexts(&record.sandbox.id);
        let adopt: Vec<(u32, u32)> = resumable
            .iter()
            .map(|(command, stream, _)| (*stream, command.pid))
            .chain(contexts.iter().map(|c| (c.stream, c.pid)))
            .collect();
        let mut welcome = space_engine::welcome_for(&spec);
        welcome.session = session;
        welcome.channel_key = record.channel_key.clone();
        let (agent, streams) = self
            .take_agent(&spec, None, |socket| {
                AgentConn::handshake_adopting(socket, welcome.clone(), ADOPT_PATIENCE, &adopt)
            })
            .await?;
        tracing::debug!(sandbox = %spec.id, ms = began.elapsed().as_millis() as u64, "re-adoption: agent taken");
        if thaw == Thaw::ForHandshake {
            self.engine.pause(&spec).await.map_err(AdoptError::engine("freeze it again"))?;
        }
        // The code contexts whose drivers still run, as they were.
        let mut streams: HashMap<u32, ExecStream> = streams.into_iter().map(|s| (s.stream, s)).collect();
        self.adopt_contexts(&record.sandbox.id, &agent, contexts, &mut streams, false);
        let sandbox_dir = self.data.sandbox_state_dir(&record.sandbox.id);
        for (command, stream, timeout_s) in resumable {
            let Some(stream) = streams.remove(&stream) else {
                // It ended while nobody listened: its end is not known.
                let _ = self.lose_command(command, "the server restarted");
                continue;
            };
            let path = transcript::path_for(&sandbox_dir, &command.id);
            let writer = TranscriptWriter::reopen(&path)
                .map_err(AdoptError::Transcript)?
                .with_limits(self.output_limits(&command.sandbox_id));
            let started = crate::ids::started_instant(command.started_at);
            self.follow(command, stream, writer, started, timeout_s);
        }
        self.changed();
        Ok(agent)
    }
}

/// Whether a sandbox whose agent is taken back is thawed for it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Thaw {
    /// It runs.
    No,
    /// Frozen: thawed for the handshake, frozen again after.
    ForHandshake,
    /// Frozen: thawed, and left running (it is being resumed).
    ForGood,
}
