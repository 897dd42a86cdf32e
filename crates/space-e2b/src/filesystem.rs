//! envd's `filesystem.Filesystem` service over the agent's file
//! operations (paths resolved inside the sandbox, by the agent).

use serde_json::{json, Value};
use space_engine::{AgentError, FileRead};
use space_proto::{DirEntry, FileFailure, PathInfo, PathOpKind};

use super::connect::RpcError;
use super::target::{agent, Target};
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
fn entry(info: &PathInfo, path: &str) -> Value {
    let mut entry = entry_base(&info.name, &info.kind, path, info.size, info.mode, info.mtime);
    entry["owner"] = json!(info.owner);
    entry["group"] = json!(info.group);
    if let Some(target) = &info.target {
        entry["symlinkTarget"] = json!(target);
        entry["isSymlink"] = json!(true);
    }
    entry
}

/// E2B's `EntryInfo` of a directory listing's entry.
fn listed(item: &DirEntry, path: &str) -> Value {
    let mut entry = entry_base(&item.name, &item.kind, path, item.size, item.mode, item.mtime);
    if item.kind == "symlink" {
        entry["isSymlink"] = json!(true);
    }
    entry
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

/// Most entries one `ListDir` answers with.
const MAX_LISTED: usize = 100_000;

/// `Stat`, `MakeDir`, `ListDir`, `Remove`, `Move`.
pub async fn unary(state: &E2bState, target: &Target, method: &str, request: Value) -> Result<Value, RpcError> {
    let (agent, _work) = match agent(state, target).await {
        Ok(found) => found,
        Err(_) => return Err(RpcError::new("unavailable", "The sandbox was not found")),
    };
    match method {
        "Stat" => {
            let path = path_of(&request, "path", target)?;
            let info = agent.path_op(PathOpKind::Stat, &path, None).await.map_err(|e| failure(e, &path))?;
            Ok(json!({"entry": entry(&info, &path)}))
        }
        "MakeDir" => {
            let path = path_of(&request, "path", target)?;
            let info = agent.path_op(PathOpKind::Mkdir, &path, None).await.map_err(|e| failure(e, &path))?;
            Ok(json!({"entry": entry(&info, &path)}))
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
            let mut entries = Vec::new();
            let mut level = vec![root.trim_end_matches('/').to_string()];
            for at_depth in 1..=depth {
                let mut next = Vec::new();
                for dir in level {
                    let listing = match agent.read_file(if dir.is_empty() { "/" } else { &dir }, false).await {
                        Ok(FileRead::Dir(listing)) => listing,
                        Ok(FileRead::File { .. }) if at_depth == 1 => {
                            return Err(RpcError::invalid(format!("{root} is not a directory")))
                        }
                        Ok(FileRead::File { .. }) => continue,
                        Err(err) if at_depth == 1 => return Err(failure(err, &dir)),
                        Err(_) => continue, // gone or unreadable below the top: skipped
                    };
                    for item in &listing.entries {
                        let path = format!("{dir}/{}", item.name);
                        entries.push(listed(item, &path));
                        if item.kind == "dir" {
                            next.push(path);
                        }
                    }
                    if entries.len() > MAX_LISTED {
                        return Err(RpcError::new(
                            "resource_exhausted",
                            format!("more than {MAX_LISTED} entries: list with a smaller depth"),
                        ));
                    }
                }
                level = next;
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
    fn permissions_read_like_ls() {
        assert_eq!(permissions("file", 0o644), "-rw-r--r--");
        assert_eq!(permissions("dir", 0o755), "drwxr-xr-x");
        assert_eq!(permissions("symlink", 0o777), "lrwxrwxrwx");
    }
}
