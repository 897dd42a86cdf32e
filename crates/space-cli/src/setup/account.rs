//! The unprivileged user and what it owns (design 35, §4 and §6): the
//! user itself, `state/`, `logs/` and `run/uploads/` of the data dir, and
//! the run dir holding the helper's socket. Every step first looks, and
//! changes only what differs, saying so in [`Changes`]; a second run
//! changes nothing.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use nix::unistd::{Group, User};

/// What a run changed, one line each, for the operator.
#[derive(Debug, Default)]
pub(crate) struct Changes(pub(crate) Vec<String>);

impl Changes {
    pub(crate) fn note(&mut self, line: String) {
        eprintln!("setup: {line}");
        self.0.push(line);
    }
}

/// The unprivileged user, as the system has it.
#[derive(Debug, Clone)]
pub(crate) struct Account {
    pub(crate) name: String,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    /// The primary group's name.
    pub(crate) group: String,
}

/// Makes the system user `name` (and its group) unless it exists. Its home
/// is the data dir, which it does not own and which is not made for it; it
/// has no login shell.
pub(crate) fn ensure_user(name: &str, home: &Path, changes: &mut Changes) -> Result<Account> {
    let made = lookup(name)?.is_none();
    if made {
        let mut useradd = Command::new(tool("useradd"));
        useradd.args(["--system", "--home-dir"]).arg(home).args(["--shell", "/usr/sbin/nologin", "--no-create-home"]);
        // `--user-group` fails when a group of that name exists already
        // (left by an earlier user, or made by hand): then it is the one.
        match Group::from_name(name).context("reading the group database")? {
            Some(_) => useradd.args(["--gid", name]),
            None => useradd.arg("--user-group"),
        };
        useradd.arg(name);
        // useradd gives up at once when another tool holds the user
        // database's lock (a package adding its own user, say).
        let mut attempt = 0;
        loop {
            let output = useradd.output().context("running useradd")?;
            let said = String::from_utf8_lossy(&output.stderr);
            match output.status.success() {
                true => break,
                false if said.contains("lock") && attempt < 10 => {
                    attempt += 1;
                    std::thread::sleep(std::time::Duration::from_millis(200 * attempt));
                }
                false => bail!("useradd {name}: {}", said.trim()),
            }
        }
    }
    let account = lookup(name)?.with_context(|| format!("useradd made no user {name}"))?;
    if account.uid == 0 {
        bail!("user {name} is root: the server must run as a user of its own, not root");
    }
    if made {
        changes.note(format!("user {name}: created (uid {}, group {})", account.uid, account.group));
    }
    Ok(account)
}

pub(crate) fn lookup(name: &str) -> Result<Option<Account>> {
    let Some(user) = User::from_name(name).context("reading the user database")? else {
        return Ok(None);
    };
    let group = Group::from_gid(user.gid)
        .context("reading the group database")?
        .map(|g| g.name)
        .unwrap_or_else(|| user.gid.to_string());
    Ok(Some(Account { name: user.name, uid: user.uid.as_raw(), gid: user.gid.as_raw(), group }))
}

/// `useradd` where Debian puts it: root's PATH under `su` (without `-`)
/// or a service manager may lack the sbin directories.
fn tool(name: &str) -> PathBuf {
    ["/usr/sbin", "/sbin"].iter().map(|dir| Path::new(dir).join(name)).find(|p| p.is_file()).unwrap_or(name.into())
}

/// A directory `path` owned by `uid:gid` with exactly `mode`, made if
/// missing (its parent must exist). A symlink or a file there is refused:
/// following it would hand whatever it names to the user.
pub(crate) fn ensure_dir(path: &Path, mode: u32, uid: u32, gid: u32, changes: &mut Changes) -> Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            fs::DirBuilder::new().mode(mode).create(path).with_context(|| format!("creating {}", path.display()))?;
            std::os::unix::fs::lchown(path, Some(uid), Some(gid))
                .with_context(|| format!("chown {}", path.display()))?;
            // The umask may have taken bits the mode asks for.
            fs::set_permissions(path, fs::Permissions::from_mode(mode))
                .with_context(|| format!("chmod {}", path.display()))?;
            changes.note(format!("{}: created ({uid}:{gid}, {mode:04o})", path.display()));
            return Ok(());
        }
        Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
    };
    if !meta.file_type().is_dir() {
        bail!("{} is not a directory (a symlink or file there is not followed): remove it", path.display());
    }
    if (meta.uid(), meta.gid()) != (uid, gid) {
        std::os::unix::fs::lchown(path, Some(uid), Some(gid)).with_context(|| format!("chown {}", path.display()))?;
        changes.note(format!("{}: owner {}:{} → {uid}:{gid}", path.display(), meta.uid(), meta.gid()));
    }
    if meta.mode() & 0o7777 != mode {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .with_context(|| format!("chmod {}", path.display()))?;
        changes.note(format!("{}: mode {:04o} → {mode:04o}", path.display(), meta.mode() & 0o7777));
    }
    Ok(())
}

/// Gives everything under `dir` to `uid:gid` (a data dir of an older
/// layout had root's database and transcripts there). Symlinks are
/// changed themselves, never followed, and no other filesystem is entered.
pub(crate) fn own_tree(dir: &Path, uid: u32, gid: u32, changes: &mut Changes) -> Result<()> {
    let device = fs::symlink_metadata(dir).with_context(|| format!("reading {}", dir.display()))?.dev();
    let mut pending = vec![dir.to_path_buf()];
    let mut changed = 0usize;
    while let Some(at) = pending.pop() {
        for entry in fs::read_dir(&at).with_context(|| format!("reading {}", at.display()))? {
            let path = entry.with_context(|| format!("reading {}", at.display()))?.path();
            let meta = fs::symlink_metadata(&path).with_context(|| format!("reading {}", path.display()))?;
            if meta.dev() != device {
                continue;
            }
            if (meta.uid(), meta.gid()) != (uid, gid) {
                std::os::unix::fs::lchown(&path, Some(uid), Some(gid))
                    .with_context(|| format!("chown {}", path.display()))?;
                changed += 1;
            }
            if meta.file_type().is_dir() {
                pending.push(path);
            }
        }
    }
    if changed > 0 {
        changes.note(format!("{}: {changed} of its entries given to {uid}:{gid}", dir.display()));
    }
    Ok(())
}

/// Narrows a file holding a key to its owner alone, if it is there.
pub(crate) fn private_file(path: &Path, changes: &mut Changes) -> Result<()> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    if meta.file_type().is_file() && meta.mode() & 0o077 != 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))
            .with_context(|| format!("chmod {}", path.display()))?;
        changes.note(format!("{}: mode {:04o} → 0600", path.display(), meta.mode() & 0o7777));
    }
    Ok(())
}

/// A directory on the way to the user's paths that the user must cross
/// and must not write (the data dir: sandbox roots under it hold
/// world-writable directories, and a writable parent would let the user
/// swap `state/` for a link). Owned by the user it goes back to root.
pub(crate) fn crossable_not_writable(path: &Path, user: &Account, changes: &mut Changes) -> Result<()> {
    let meta = fs::symlink_metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.file_type().is_dir() {
        bail!("{} is not a directory", path.display());
    }
    if meta.uid() == user.uid || meta.gid() == user.gid {
        std::os::unix::fs::lchown(path, Some(0), Some(0)).with_context(|| format!("chown {}", path.display()))?;
        changes.note(format!("{}: owner {}:{} → 0:0", path.display(), meta.uid(), meta.gid()));
    }
    let mode = meta.mode() & 0o7777;
    let wanted = (mode & !0o022) | 0o011;
    if wanted != mode {
        fs::set_permissions(path, fs::Permissions::from_mode(wanted))
            .with_context(|| format!("chmod {}", path.display()))?;
        changes.note(format!("{}: mode {mode:04o} → {wanted:04o}", path.display()));
    }
    Ok(())
}

/// Writes `content` to `path` (mode 0644, by rename) unless it holds it
/// already; true when it wrote.
pub(crate) fn write_if_changed(path: &Path, content: &str, changes: &mut Changes) -> Result<bool> {
    if fs::read_to_string(path).is_ok_and(|old| old == content) {
        return Ok(false);
    }
    let existed = path.exists();
    let partial = path.with_extension("partial");
    fs::write(&partial, content).with_context(|| format!("writing {}", partial.display()))?;
    fs::set_permissions(&partial, fs::Permissions::from_mode(0o644))
        .with_context(|| format!("chmod {}", partial.display()))?;
    fs::rename(&partial, path).with_context(|| format!("writing {}", path.display()))?;
    changes.note(format!("{}: {}", path.display(), if existed { "rewritten" } else { "written" }));
    Ok(true)
}
