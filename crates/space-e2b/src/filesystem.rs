//! envd's `filesystem.Filesystem` service over the agent's file
//! operations (paths resolved inside the sandbox, by the agent).

use serde_json::{json, Value};
use space_engine::{AgentConn, AgentError, FileRead};
use space_proto::{DirEntry, FileFailure, PathInfo, PathOpKind, PathRequest};

use super::connect::RpcError;
use super::envd::{acting, owner_of};
use super::target::Target;
use crate::E2bState;

/// E2B's `FileType` for a SPACE file kind.
fn file_type(kind: &str) -> &'static str {
    match kind {
        "file" => "FILE_TYPE_FILE",
        "dir" => "FILE_TYPE_DIRECTORY",
        "symlink" => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_UNSPECIFIED",
    }
}

/// `ls -l`'s permission string, such as `-rw-r--r--`.
fn permissions(kind: &str, mode: u32) -> String {
    let first = match kind {
        "dir" => 'd',
        "symlink" => 'l',
        _ => '-',
    };
    let mut text = String::with_capacity(10);
    text.push(first);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        text.push(if bits & 4 != 0 { 'r' } else { '-' });
        text.push(if bits & 2 != 0 { 'w' } else { '-' });
        text.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    text
}

fn modified(mtime: i64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime.max(0) as u64);
    humantime::format_rfc3339_seconds(at).to_string()
}

/// E2B's `EntryInfo`: what every entry has.
fn entry_base(name: &str, kind: &str, path: &str, size: u64, mode: u32, mtime: i64) -> Value {
    json!({
        "name": name,
        "type": file_type(kind),
        "path": path,
        "size": size.to_string(),
        "mode": mode & 0o777,
        "permissions": permissions(kind, mode),
        "modifiedTime": modified(mtime),
    })
}

/// E2B's `EntryInfo` of a described path.
pub(crate) fn entry(info: &PathInfo, path: &str) -> Value {
    let mut entry = entry_base(&info.name, &info.kind, path, info.size, info.mode, info.mtime);
    entry["owner"] = json!(info.owner);
    entry["group"] = json!(info.group);
    if let Some(target) = &info.target {
        entry["symlinkTarget"] = json!(target);
    }
    entry
}

/// E2B's `EntryInfo` of a directory listing's entry.
fn listed(item: &DirEntry, path: &str) -> Value {
    let mut entry = entry_base(&item.name, &item.kind, path, item.size, item.mode, item.mtime);
    if let (Some(owner), Some(group)) = (&item.owner, &item.group) {
        entry["owner"] = json!(owner);
        entry["group"] = json!(group);
    }
    entry
}

/// `path` with `.` and `..` taken out, as text (`..` at the root stays there).
fn lexical(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Where a symlink at `link` pointing to `target` leads, as an absolute path.
fn resolve_link(link: &str, target: &str) -> String {
    if target.starts_with('/') {
        return lexical(target);
    }
    let dir = link.rsplit_once('/').map_or("/", |(dir, _)| if dir.is_empty() { "/" } else { dir });
    lexical(&format!("{dir}/{target}"))
}

/// How many symlinks a path may pass through (Linux's `MAXSYMLINKS`).
const MAX_LINKS: usize = 40;

/// envd describes a symlink by what it leads to: the target's type, size,
/// mode and owner, with `symlinkTarget` its absolute path; the name and
/// path stay the link's. A dangling link (or a loop) is described as the
/// link itself.
async fn followed(agent: &AgentConn, path: &str, info: PathInfo) -> PathInfo {
    if info.kind != "symlink" {
        return info;
    }
    let mut at = path.to_string();
    let mut current = info.clone();
    for _ in 0..MAX_LINKS {
        let Some(target) = current.target.as_deref().filter(|_| current.kind == "symlink") else {
            return PathInfo { name: info.name, target: Some(at), ..current };
        };
        at = resolve_link(&at, target);
        match agent.path_op(PathOpKind::Stat, &at, None).await {
            Ok(next) => current = next,
            Err(_) => break,
        }
    }
    info
}

fn failure(err: AgentError, path: &str) -> RpcError {
    match err {
        AgentError::File(error) => match error.reason {
            FileFailure::NotFound => RpcError::not_found(format!("{path}: no such file or directory")),
            FileFailure::Exists => RpcError::new("already_exists", error.message),
            FileFailure::PermissionDenied => RpcError::new("permission_denied", error.message),
            FileFailure::WrongType | FileFailure::Invalid | FileFailure::NotEmpty => RpcError::invalid(error.message),
            FileFailure::Io => RpcError::new("internal", error.message),
        },
        AgentError::Disconnected | AgentError::Timeout(_) => {
            RpcError::new("unavailable", "The sandbox was not found: it stopped during the call")
        }
        other => RpcError::new("internal", other.to_string()),
    }
}

fn path_of(request: &Value, field: &str, target: &Target) -> Result<String, RpcError> {
    let given = request.get(field).and_then(Value::as_str).unwrap_or_default();
    Ok(target.path(given))
}

/// How long a `MakeDir` may take.
const MKDIR_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// Most entries one `ListDir` answers with.
const MAX_LISTED: usize = 100_000;

/// `Stat`, `MakeDir`, `ListDir`, `Remove`, `Move` and the watchers'
/// `CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`.
pub async fn unary(state: &E2bState, target: &mut Target, method: &str, request: Value) -> Result<Value, RpcError> {
    let (agent, _work) = match acting(state, target).await {
        Ok(found) => found,
        Err(_) => return Err(RpcError::new("unavailable", "The sandbox was not found")),
    };
    let target = &*target;
    match method {
        "Stat" => {
            let path = path_of(&request, "path", target)?;
            let info = agent.path_op(PathOpKind::Stat, &path, None).await.map_err(|e| failure(e, &path))?;
            let info = followed(&agent, &path, info).await;
            Ok(json!({"entry": entry(&info, &path)}))
        }
        "MakeDir" => {
            let path = path_of(&request, "path", target)?;
            let made = PathRequest { op: PathOpKind::Mkdir, path: path.clone(), to: None, owner: owner_of(target) };
            // Bounded: an agent older than the request's owner field (a
            // sandbox adopted across an upgrade) never answers it.
            let info = tokio::time::timeout(MKDIR_PATIENCE, agent.path_op_with(made))
                .await
                .map_err(|_| RpcError::new("unavailable", "the sandbox's agent did not answer"))?
                .map_err(|e| failure(e, &path))?;
            Ok(json!({"entry": entry(&info, &path)}))
        }
        "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
            super::watch::unary(&agent, target, method, &request).await
        }
        "Move" => {
            let source = path_of(&request, "source", target)?;
            let destination = path_of(&request, "destination", target)?;
            let info =
                agent.path_op(PathOpKind::Move, &source, Some(&destination)).await.map_err(|e| failure(e, &source))?;
            Ok(json!({"entry": entry(&info, &destination)}))
        }
        "Remove" => {
            let path = path_of(&request, "path", target)?;
            match agent.delete_path(&path, true).await {
                Ok(()) => Ok(json!({})),
                // envd removes with RemoveAll: nothing there is success.
                Err(AgentError::File(error)) if error.reason == FileFailure::NotFound => Ok(json!({})),
                Err(err) => Err(failure(err, &path)),
            }
        }
        "ListDir" => {
            let root = path_of(&request, "path", target)?;
            let depth = request.get("depth").and_then(Value::as_u64).unwrap_or(1).max(1);
            let info = agent.path_op(PathOpKind::Stat, &root, None).await.map_err(|e| failure(e, &root))?;
            if info.kind != "dir" && info.kind != "symlink" {
                return Err(RpcError::invalid(format!("{root} is not a directory")));
            }
            // Depth first, each directory's entries by name (the agent
            // sorts them), a directory's own entries right after it, as
            // envd walks.
            let top = root.trim_end_matches('/').to_string();
            let first = match agent.read_file(if top.is_empty() { "/" } else { &top }, false).await {
                Ok(FileRead::Dir(listing)) => listing,
                Ok(FileRead::File { .. }) => return Err(RpcError::invalid(format!("{root} is not a directory"))),
                Err(err) => return Err(failure(err, &root)),
            };
            let mut entries = Vec::new();
            let mut stack = vec![(top, 1u64, first.entries.into_iter())];
            while let Some((dir, at_depth, rest)) = stack.last_mut() {
                let Some(item) = rest.next() else {
                    stack.pop();
                    continue;
                };
                let (path, at_depth) = (format!("{dir}/{}", item.name), *at_depth);
                entries.push(match (&item.kind[..], &item.target) {
                    ("symlink", Some(link)) => {
                        let info = PathInfo {
                            name: item.name.clone(),
                            kind: item.kind.clone(),
                            size: item.size,
                            mode: item.mode,
                            mtime: item.mtime,
                            owner: item.owner.clone().unwrap_or_default(),
                            group: item.group.clone().unwrap_or_default(),
                            target: Some(link.clone()),
                        };
                        entry(&followed(&agent, &path, info).await, &path)
                    }
                    _ => listed(&item, &path),
                });
                if entries.len() > MAX_LISTED {
                    return Err(RpcError::new(
                        "resource_exhausted",
                        format!("more than {MAX_LISTED} entries: list with a smaller depth"),
                    ));
                }
                if item.kind == "dir" && at_depth < depth {
                    // Gone or unreadable below the top: skipped.
                    if let Ok(FileRead::Dir(listing)) = agent.read_file(&path, false).await {
                        stack.push((path, at_depth + 1, listing.entries.into_iter()));
                    }
                }
            }
            Ok(json!({"entries": entries}))
        }
        _ => Err(RpcError::new("unimplemented", format!("filesystem.Filesystem/{method} is not served by SPACE"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_resolve_against_their_directory() {
        assert_eq!(resolve_link("/home/user/d/link", "test.txt"), "/home/user/d/test.txt");
        assert_eq!(resolve_link("/home/user/d/link", "../x/./y"), "/home/user/x/y");
        assert_eq!(resolve_link("/home/user/d/link", "/etc//passwd"), "/etc/passwd");
        assert_eq!(resolve_link("/link", "../../a"), "/a");
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions("file", 0o644), "-rw-r--r--");
        assert_eq!(permissions("dir", 0o755), "drwxr-xr-x");
        assert_eq!(permissions("symlink", 0o777), "lrwxrwxrwx");
    }
}
