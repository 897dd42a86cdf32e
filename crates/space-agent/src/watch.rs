//! `space-agent watch [--recursive] [--entries] DIR`: reports what changes
//! in a directory, as a program in the sandbox (started like any command,
//! through the agent): inotify sees only changes made inside the sandbox,
//! which under gVisor is every change there is.
//!
//! Its stdout is one JSON object per line: `{"ready": true}` once every
//! watch is in place, then one per change, `{"name": "a/b.txt", "type":
//! "create"}` (`name` relative to DIR; `type` one of `create`, `write`,
//! `remove`, `rename`, `chmod`; with `--entries`, the path's `entry` as a
//! stat describes it, if it is still there). A line `sync` on its stdin is
//! answered, once every change made before it is reported, with
//! `{"synced": true}`: a caller that made a change and then syncs has seen
//! its events. It ends at the end of its stdin, or when DIR goes.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

use serde_json::{json, Value};

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

/// Runs the watcher; returns the process's exit code.
pub fn main(args: &[String]) -> i32 {
    let mut recursive = false;
    let mut entries = false;
    let mut dir = None;
    for arg in args {
        match arg.as_str() {
            "--recursive" => recursive = true,
            "--entries" => entries = true,
            other if dir.is_none() && !other.starts_with("--") => dir = Some(PathBuf::from(other)),
            other => {
                eprintln!("watch: unexpected argument {other:?}");
                return 2;
            }
        }
    }
    let Some(dir) = dir else {
        eprintln!("watch: name a directory");
        return 2;
    };
    match std::fs::metadata(&dir) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            eprintln!("not_found: {}: no such directory", dir.display());
            return 3;
        }
        Err(err) => {
            eprintln!("invalid: {}: {err}", dir.display());
            return 4;
        }
        Ok(meta) if !meta.is_dir() => {
            eprintln!("invalid: {}: not a directory", dir.display());
            return 4;
        }
        Ok(_) => {}
    }
    match Watcher::start(dir, recursive, entries).and_then(Watcher::serve) {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("watch: {err}");
            1
        }
    }
}

struct Watcher {
    inotify: OwnedFd,
    root: PathBuf,
    recursive: bool,
    entries: bool,
    /// Each watch's directory, relative to the root ("" for the root).
    dirs: HashMap<i32, PathBuf>,
    out: Box<dyn Write>,
}

impl Watcher {
    fn start(root: PathBuf, recursive: bool, entries: bool) -> io::Result<Watcher> {
        Watcher::start_to(root, recursive, entries, Box::new(io::stdout()))
    }

    fn start_to(root: PathBuf, recursive: bool, entries: bool, out: Box<dyn Write>) -> io::Result<Watcher> {
        // SAFETY: plain syscall; the fd is owned from here on.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let inotify = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut watcher = Watcher { inotify, root, recursive, entries, dirs: HashMap::new(), out };
        watcher.add(PathBuf::new())?;
        watcher.line(&json!({"ready": true}))?;
        Ok(watcher)
    }

    /// Watches a directory (relative to the root) and, when recursive,
    /// every directory below it.
    fn add(&mut self, relative: PathBuf) -> io::Result<()> {
        let path = self.root.join(&relative);
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: a valid fd and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.inotify.as_raw_fd(), c_path.as_ptr(), MASK | libc::IN_ONLYDIR) };
        if wd < 0 {
            let err = io::Error::last_os_error();
            // A directory below the root that went meanwhile is no error.
            return if relative.as_os_str().is_empty() { Err(err) } else { Ok(()) };
        }
        self.dirs.insert(wd, relative.clone());
        if self.recursive {
            for entry in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    self.add(relative.join(entry.file_name()))?;
                }
            }
        }
        Ok(())
    }

    fn line(&mut self, value: &Value) -> io::Result<()> {
        let mut text = value.to_string();
        text.push('\n');
        self.out.write_all(text.as_bytes())?;
        self.out.flush()
    }

    fn serve(mut self) -> io::Result<()> {
        let mut stdin_buf = Vec::new();
        loop {
            let mut fds = [
                libc::pollfd { fd: self.inotify.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: 0, events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: two valid pollfds.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if ready < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            if fds[0].revents != 0 && !self.drain()? {
                return Ok(()); // the directory went
            }
            if fds[1].revents != 0 {
                let mut chunk = [0u8; 256];
                let n = io::stdin().read(&mut chunk)?;
                if n == 0 {
                    return Ok(());
                }
                stdin_buf.extend_from_slice(&chunk[..n]);
                while let Some(end) = stdin_buf.iter().position(|b| *b == b'\n') {
                    let asked: Vec<u8> = stdin_buf.drain(..=end).collect();
                    if asked.trim_ascii() == b"sync" {
                        // Whatever was queued before the question is out first.
                        if !self.drain()? {
                            return Ok(());
                        }
                        self.line(&json!({"synced": true}))?;
                    }
                }
            }
        }
    }

    /// Reports every queued event; false once the root is gone.
    fn drain(&mut self) -> io::Result<bool> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: reads into a buffer of the length given.
            let n = unsafe { libc::read(self.inotify.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let err = io::Error::last_os_error();
                return match err.kind() {
                    io::ErrorKind::WouldBlock => Ok(true),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(err),
                };
            }
            let n = n as usize;
            let mut at = 0;
            while at + 16 <= n {
                let field =
                    |i: usize| u32::from_ne_bytes([buf[at + i], buf[at + i + 1], buf[at + i + 2], buf[at + i + 3]]);
                let (wd, mask, len) = (field(0) as i32, field(4), field(12) as usize);
                let name_bytes = &buf[at + 16..(at + 16 + len).min(n)];
                let name_end = name_bytes.iter().position(|b| *b == 0).unwrap_or(name_bytes.len());
                let name = String::from_utf8_lossy(&name_bytes[..name_end]).into_owned();
                at += 16 + len;
                if !self.event(wd, mask, &name)? {
                    return Ok(false);
                }
            }
        }
    }

    /// Reports one event; false once the root is gone.
    fn event(&mut self, wd: i32, mask: u32, name: &str) -> io::Result<bool> {
        let Some(dir) = self.dirs.get(&wd).cloned() else { return Ok(true) };
        if mask & libc::IN_IGNORED != 0 {
            self.dirs.remove(&wd);
            return Ok(!dir.as_os_str().is_empty());
        }
        if mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0 {
            // Reported by its parent (or, for the root, the end).
            return Ok(!dir.as_os_str().is_empty());
        }
        let kind = if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
            "create"
        } else if mask & libc::IN_MODIFY != 0 {
            "write"
        } else if mask & libc::IN_DELETE != 0 {
            "remove"
        } else if mask & libc::IN_MOVED_FROM != 0 {
            "rename"
        } else if mask & libc::IN_ATTRIB != 0 {
            "chmod"
        } else {
            return Ok(true);
        };
        let relative = dir.join(name);
        // A new directory is watched before anyone hears of it: what is
        // made in it next is seen.
        if self.recursive && kind == "create" && mask & libc::IN_ISDIR != 0 {
            self.add(relative.clone())?;
        }
        let mut reported = json!({"name": relative.to_string_lossy(), "type": kind});
        if self.entries {
            if let Ok(info) = crate::files::describe(&self.root.join(&relative)) {
                reported["entry"] = serde_json::to_value(info).unwrap_or(Value::Null);
            }
        }
        self.line(&reported)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_directory_is_named_as_such() {
        assert_eq!(main(&["/no/such/dir/for/watching".to_string()]), 3);
        assert_eq!(main(&["/proc/self/status".to_string()]), 4);
        assert_eq!(main(&[]), 2);
    }

    /// What the watcher wrote, as JSON lines.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Lines {
        fn take(&self) -> Vec<Value> {
            let text = String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap();
            text.lines().map(|line| serde_json::from_str(line).unwrap()).collect()
        }
    }

    #[test]
    fn changes_are_reported_by_relative_name_and_new_directories_are_watched() {
        let root = std::env::temp_dir().join(format!("space-watch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("old")).unwrap();
        let lines = Lines::default();
        let mut watcher = Watcher::start_to(root.clone(), true, true, Box::new(lines.clone())).unwrap();
        assert_eq!(lines.take(), vec![json!({"ready": true})]);

        std::fs::write(root.join("old/a.txt"), "one").unwrap();
        std::fs::create_dir(root.join("new")).unwrap();
        assert!(watcher.drain().unwrap());
        std::fs::write(root.join("new/b.txt"), "two").unwrap();
        std::fs::rename(root.join("new/b.txt"), root.join("new/c.txt")).unwrap();
        std::fs::remove_file(root.join("old/a.txt")).unwrap();
        assert!(watcher.drain().unwrap());
        let seen: Vec<(String, String)> = lines
            .take()
            .iter()
            .map(|e| (e["type"].as_str().unwrap().to_string(), e["name"].as_str().unwrap().to_string()))
            .collect();
        let want = |kind: &str, name: &str| (kind.to_string(), name.to_string());
        assert_eq!(
            seen,
            vec![
                want("create", "old/a.txt"),
                want("write", "old/a.txt"),
                want("create", "new"),
                want("create", "new/b.txt"),
                want("write", "new/b.txt"),
                want("rename", "new/b.txt"),
                want("create", "new/c.txt"),
                want("remove", "old/a.txt"),
            ]
        );

        std::fs::remove_dir_all(&root).unwrap();
        assert!(!watcher.drain().unwrap(), "the root's going ends the watch");
    }
}
