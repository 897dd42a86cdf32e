//! envd's directory watchers: `WatchDir` (a stream, what the async SDK
//! uses) and `CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher` (polling,
//! the sync SDK's). Each watcher is a program in the sandbox, the agent's
//! `watch` mode (inotify there; see `space-agent`'s `watch.rs`), started
//! through the agent like a command but not one of the sandbox's commands:
//! a process of envd's own, as in E2B.
//!
//! A poll first has the watcher report everything queued before it (a
//! `sync` on its stdin), so a change the caller made before it polls is in
//! the answer, as envd's in-process watcher gives.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use space_engine::{AgentConn, ExecEvent};
use space_proto::{ExecRequest, PathInfo};
use tokio::sync::{mpsc, watch};

use super::connect::{end, message, stream_response, RpcError};
use super::filesystem::entry;
use super::target::Target;
use super::wire::header;

/// The agent's binary inside a sandbox, run in its `watch` mode.
const WATCHER: &str = "/.space/space-agent";
/// Events a watcher keeps for a poll; past it, the oldest go.
const MAX_KEPT: usize = 10_000;
/// Watchers one sandbox may have polled at once.
const MAX_POLLED: usize = 64;
/// How long a watcher may take to start, or to answer a sync.
const PATIENCE: Duration = Duration::from_secs(15);
/// How often an idle `WatchDir` stream says it is alive, unless the client
/// asks (`Keepalive-Ping-Interval`, seconds).
const KEEPALIVE: Duration = Duration::from_secs(50);

/// What a watcher's reader has seen so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Progress {
    syncs: u64,
    events: u64,
    ended: bool,
}

/// A running watcher: its events as they come, its process killed when
/// dropped.
struct Watcher {
    agent: AgentConn,
    stream: u32,
    kept: Arc<Mutex<VecDeque<Value>>>,
    progress: watch::Receiver<Progress>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.reader.abort();
        let (agent, stream) = (self.agent.clone(), self.stream);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = agent.signal(stream, nix::sys::signal::Signal::SIGKILL as i32).await;
            });
        }
    }
}

/// One line of the watcher's stdout.
enum Line {
    Ready,
    Synced,
    Event(Value),
}

fn parse(line: &[u8]) -> Option<Line> {
    let value: Value = serde_json::from_slice(line).ok()?;
    if value.get("ready").is_some() {
        Some(Line::Ready)
    } else if value.get("synced").is_some() {
        Some(Line::Synced)
    } else {
        Some(Line::Event(value))
    }
}

/// Splits complete lines off `buffer`.
fn lines(buffer: &mut Vec<u8>, more: &[u8]) -> Vec<Line> {
    buffer.extend_from_slice(more);
    let mut out = Vec::new();
    while let Some(at) = buffer.iter().position(|b| *b == b'\n') {
        let line: Vec<u8> = buffer.drain(..=at).collect();
        out.extend(parse(&line[..line.len() - 1]));
    }
    out
}

/// E2B's `FilesystemEvent` for one of the watcher's events.
fn event(root: &str, reported: &Value) -> Option<Value> {
    let kind = match reported["type"].as_str()? {
        "create" => "EVENT_TYPE_CREATE",
        "write" => "EVENT_TYPE_WRITE",
        "remove" => "EVENT_TYPE_REMOVE",
        "rename" => "EVENT_TYPE_RENAME",
        "chmod" => "EVENT_TYPE_CHMOD",
        _ => return None,
    };
    let name = reported["name"].as_str()?;
    let mut out = json!({"name": name, "type": kind});
    if let Some(info) = reported.get("entry").and_then(|e| serde_json::from_value::<PathInfo>(e.clone()).ok()) {
        out["entry"] = entry(&info, &format!("{}/{name}", root.trim_end_matches('/')));
    }
    Some(out)
}

impl Watcher {
    /// Starts a watcher on `path` (absolute); returns once it watches.
    async fn start(agent: &AgentConn, path: &str, recursive: bool, entries: bool) -> Result<Watcher, RpcError> {
        let mut argv = vec![WATCHER.to_string(), "watch".to_string()];
        if recursive {
            argv.push("--recursive".into());
        }
        if entries {
            argv.push("--entries".into());
        }
        argv.push(path.to_string());
        let request = ExecRequest { argv, env: Default::default(), cwd: None, user: None, stdin: true, tty: false };
        let unavailable = |why: String| RpcError::new("unavailable", format!("the sandbox's watcher: {why}"));
        let mut exec = agent.exec(&request).await.map_err(|e| unavailable(e.to_string()))?;
        let stream = exec.stream;
        let (mut buffer, mut stderr) = (Vec::new(), Vec::new());
        let started = tokio::time::timeout(PATIENCE, async {
            loop {
                match exec.next().await {
                    Some(ExecEvent::Stdout(bytes)) => {
                        if lines(&mut buffer, &bytes).iter().any(|l| matches!(l, Line::Ready)) {
                            return Ok(());
                        }
                    }
                    Some(ExecEvent::Stderr(bytes)) => stderr.extend_from_slice(&bytes),
                    Some(ExecEvent::Exit(_)) | None => {
                        let said = String::from_utf8_lossy(&stderr).trim().to_string();
                        return Err(if let Some(why) = said.strip_prefix("not_found: ") {
                            RpcError::not_found(why.to_string())
                        } else if let Some(why) = said.strip_prefix("invalid: ") {
                            RpcError::invalid(why.to_string())
                        } else {
                            unavailable(said)
                        });
                    }
                }
            }
        })
        .await
        .unwrap_or_else(|_| Err(unavailable("it did not start in time".into())));
        if let Err(err) = started {
            let _ = agent.signal(stream, nix::sys::signal::Signal::SIGKILL as i32).await;
            return Err(err);
        }
        let kept = Arc::new(Mutex::new(VecDeque::new()));
        let (report, progress) = watch::channel(Progress::default());
        // Read all the time, whoever listens: the agent's channel carries
        // every stream of the sandbox, and a stream left unread holds it up.
        let reader = {
            let (kept, root) = (kept.clone(), path.to_string());
            tokio::spawn(async move {
                loop {
                    let bytes = match exec.next().await {
                        Some(ExecEvent::Stdout(bytes)) => bytes,
                        Some(ExecEvent::Stderr(_)) => continue,
                        Some(ExecEvent::Exit(_)) | None => break,
                    };
                    for line in lines(&mut buffer, &bytes) {
                        match line {
                            Line::Ready => {}
                            Line::Synced => report.send_modify(|p| p.syncs += 1),
                            Line::Event(reported) => {
                                let Some(event) = event(&root, &reported) else { continue };
                                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                                if kept.len() >= MAX_KEPT {
                                    kept.pop_front();
                                }
                                kept.push_back(event);
                                drop(kept);
                                report.send_modify(|p| p.events += 1);
                            }
                        }
                    }
                }
                report.send_modify(|p| p.ended = true);
            })
        };
        Ok(Watcher { agent: agent.clone(), stream, kept, progress, reader })
    }

    fn take(&self) -> Vec<Value> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect()
    }

    /// Waits until the watcher has reported every change made before now.
    async fn sync(&mut self) -> Result<(), RpcError> {
        let before = self.progress.borrow_and_update().syncs;
        self.agent
            .send_stdin(self.stream, b"sync\n".to_vec())
            .await
            .map_err(|_| RpcError::new("unavailable", "The sandbox was not found"))?;
        let synced = tokio::time::timeout(PATIENCE, self.progress.wait_for(|p| p.syncs > before || p.ended)).await;
        match synced {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(RpcError::new("unavailable", "the watcher stopped")),
            Err(_) => Err(RpcError::new("deadline_exceeded", "the watcher did not answer in time")),
        }
    }
}

/// A polled watcher, by its id.
struct Polled {
    sandbox: String,
    watcher: Arc<tokio::sync::Mutex<Watcher>>,
}

fn polled() -> &'static Mutex<HashMap<String, Polled>> {
    static POLLED: OnceLock<Mutex<HashMap<String, Polled>>> = OnceLock::new();
    POLLED.get_or_init(Default::default)
}

fn new_id() -> String {
    let mut bytes = [0u8; 12];
    getrandom::getrandom(&mut bytes).expect("the system's random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The polled watcher `id` of this sandbox (another's is not found).
fn polled_watcher(target: &Target, request: &Value) -> Result<(String, Arc<tokio::sync::Mutex<Watcher>>), RpcError> {
    let id = request.get("watcherId").and_then(Value::as_str).unwrap_or_default().to_string();
    let watchers = polled().lock().unwrap_or_else(|e| e.into_inner());
    match watchers.get(&id) {
        Some(found) if found.sandbox == target.id => Ok((id, found.watcher.clone())),
        _ => Err(RpcError::not_found(format!("watcher {id} not found"))),
    }
}

fn flag(request: &Value, field: &str) -> bool {
    request.get(field).and_then(Value::as_bool).unwrap_or(false)
}

/// `CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`.
pub async fn unary(agent: &AgentConn, target: &Target, method: &str, request: &Value) -> Result<Value, RpcError> {
    match method {
        "CreateWatcher" => {
            let path = target.path(request.get("path").and_then(Value::as_str).unwrap_or_default());
            let count = {
                let mut watchers = polled().lock().unwrap_or_else(|e| e.into_inner());
                // Watchers whose sandbox's agent went away watch nothing.
                watchers.retain(|_, p| p.watcher.try_lock().map_or(true, |w| !w.progress.borrow().ended));
                watchers.values().filter(|p| p.sandbox == target.id).count()
            };
            if count >= MAX_POLLED {
                return Err(RpcError::new(
                    "resource_exhausted",
                    format!("a sandbox may have {MAX_POLLED} watchers: remove one first"),
                ));
            }
            let watcher =
                Watcher::start(agent, &path, flag(request, "recursive"), flag(request, "includeEntry")).await?;
            let id = new_id();
            let polled_one = Polled { sandbox: target.id.clone(), watcher: Arc::new(tokio::sync::Mutex::new(watcher)) };
            polled().lock().unwrap_or_else(|e| e.into_inner()).insert(id.clone(), polled_one);
            Ok(json!({"watcherId": id}))
        }
        "GetWatcherEvents" => {
            let (id, watcher) = polled_watcher(target, request)?;
            let mut watcher = watcher.lock().await;
            let synced = watcher.sync().await;
            let events = watcher.take();
            if watcher.progress.borrow().ended {
                // Its directory went (or the sandbox stopped): this was its last answer.
                polled().lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            } else {
                synced?;
            }
            Ok(json!({"events": events}))
        }
        "RemoveWatcher" => {
            let (id, _) = polled_watcher(target, request)?;
            polled().lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            Ok(json!({}))
        }
        _ => Err(RpcError::new("unimplemented", format!("filesystem.Filesystem/{method} is not served by SPACE"))),
    }
}

/// `WatchDir`: a stream of `{"start": {}}` once the watcher watches (the
/// response's oneof, written without its name), then `{"filesystem":
/// FilesystemEvent}` for each change (keepalives while quiet), until the client goes, the directory
/// goes, or `Connect-Timeout-Ms` passes (then `deadline_exceeded`, as
/// Connect ends a call past its deadline).
pub async fn stream(agent: &AgentConn, target: &Target, headers: &HeaderMap, request: &Value) -> Response {
    let path = target.path(request.get("path").and_then(Value::as_str).unwrap_or_default());
    let watcher = match Watcher::start(agent, &path, flag(request, "recursive"), flag(request, "includeEntry")).await {
        Ok(watcher) => watcher,
        Err(err) => return err.into_response(),
    };
    let deadline = header(headers, "connect-timeout-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    let keepalive = header(headers, "keepalive-ping-interval")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(KEEPALIVE, Duration::from_secs);
    let (frames, out) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        let mut watcher = watcher;
        let send = |value: Value| frames.send(Ok(message(&value)));
        if send(json!({"start": {}})).await.is_err() {
            return;
        }
        let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        let ending = loop {
            for event in watcher.take() {
                if send(json!({"filesystem": event})).await.is_err() {
                    return; // the client went away: the watcher goes with it
                }
            }
            if watcher.progress.borrow().ended {
                break None;
            }
            tokio::select! {
                changed = watcher.progress.changed() => {
                    if changed.is_err() {
                        break None;
                    }
                }
                _ = tokio::time::sleep(keepalive) => {
                    if send(json!({"keepalive": {}})).await.is_err() {
                        return;
                    }
                }
                // The client went away: the watcher goes at once.
                _ = frames.closed() => return,
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => {
                    break Some(RpcError::new("deadline_exceeded", "the watch's timeout elapsed"));
                }
            }
        };
        let _ = frames.send(Ok(end(ending.as_ref()))).await;
    });
    stream_response(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_across_chunks() {
        let mut buffer = Vec::new();
        assert!(lines(&mut buffer, b"{\"ready\":tr").is_empty());
        let got = lines(&mut buffer, b"ue}\n{\"name\":\"a\",\"type\":\"write\"}\n{\"synced\":true}\n{\"na");
        assert!(matches!(got[..], [Line::Ready, Line::Event(_), Line::Synced]));
        assert_eq!(buffer, b"{\"na");
    }

    #[test]
    fn events_are_named_as_envd_names_them() {
        let reported = json!({"name": "d/a.txt", "type": "create", "entry": {
            "name": "a.txt", "type": "file", "size": 3, "mode": 420, "mtime": 0, "owner": "user", "group": "user"
        }});
        let out = event("/home/user/w/", &reported).unwrap();
        assert_eq!(out["type"], "EVENT_TYPE_CREATE");
        assert_eq!(out["name"], "d/a.txt");
        assert_eq!(out["entry"]["path"], "/home/user/w/d/a.txt");
        assert_eq!(out["entry"]["type"], "FILE_TYPE_FILE");
        assert!(event("/", &json!({"name": "x", "type": "open"})).is_none());
    }
}
