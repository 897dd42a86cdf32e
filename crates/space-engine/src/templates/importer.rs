//! The confined importer child (decision 027): an OCI archive is a
//! tenant's bytes (tar, gzip, JSON), so the root process that builds a
//! template (the helper, or a server without one) never parses it. It
//! starts `space` again as [`SUBCOMMAND`]; that child confines itself
//! ([`space_privsep::confine::confine_keeping`]: root, but only the
//! capabilities of giving files their owners and modes, `no_new_privs`,
//! Landlock to the build's root and work dir, the build dir as its root
//! directory, the seccomp deny-list and no new processes), says so, and
//! reads no byte of the archive until the parent, having checked its
//! `/proc/PID/status`, answers; then it applies the layers and reports,
//! one JSON [`Report`] a line. Its stdout is a socket to the parent (the
//! reports one way, the go-ahead the other); its stdin is the archive and
//! its stderr the build's log, both descriptors the parent was handed; it
//! opens no path of either.
//!
//! What needs more than that stays with the parent: making and limiting
//! the root subvolume before, installing the agent and sealing the root
//! after, once the child has ended (it cannot leave a process behind).

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use space_host::oci::Imported;
use space_host::template::BuildProgress;
use space_host::HostError;
use space_privsep::confine::{self, cap, Keeping};
use space_privsep::proto::BlobDigest;
use space_process::{ExitStatus, ReapedChild, Reaper};

/// The hidden `space` subcommand the child runs as.
pub const SUBCOMMAND: &str = "import-oci-child";

/// What the child keeps: giving files their owners (CAP_CHOWN), and their
/// modes and times whoever owns them (CAP_FOWNER, CAP_FSETID for setuid
/// and setgid bits), in directories of any mode (CAP_DAC_OVERRIDE).
/// Layers' device nodes are skipped, not made (the engine provides
/// `/dev`), so no CAP_MKNOD; no extended attribute is applied, so no
/// CAP_SETFCAP.
pub const KEPT_CAPABILITIES: [u32; 4] = [cap::CHOWN, cap::DAC_OVERRIDE, cap::FOWNER, cap::FSETID];

/// Where the child finds the root and its work dir, inside its own root
/// (the build dir).
const ROOTFS_INSIDE: &str = "/rootfs";
const WORK_INSIDE: &str = "/work";

/// The longest the child may go without a report: a layer's one huge
/// file is written without one, at disk speed.
const SILENCE_PATIENCE: Duration = Duration::from_secs(600);
/// How long the child may take to end once its stdout closed.
const EXIT_PATIENCE: Duration = Duration::from_secs(10);
/// The longest report line read from the child (its result carries the
/// image's environment, bounded by the config's size in the importer).
const MAX_REPORT: usize = 16 << 20;

/// One line of the child's stdout.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "report", rename_all = "snake_case", deny_unknown_fields)]
enum Report {
    /// Confinement is in place; nothing of the archive has been read yet.
    Confined {
        landlock: String,
    },
    Progress {
        step: String,
        done: u64,
        bytes: Option<[u64; 2]>,
    },
    Imported {
        imported: Imported,
    },
    /// `invalid`: the archive's fault, `message` told to whoever sent it.
    Failed {
        invalid: bool,
        message: String,
    },
}

/// A failure of the child itself, not of the archive.
fn child_failed(message: String) -> HostError {
    HostError::CommandFailed { command: format!("space {SUBCOMMAND}"), status: "failed".into(), stderr: message }
}

/// Applies the image in `archive` to `rootfs` (a directory of the build
/// dir `partial`, made and limited by the caller) in a confined child
/// started from `importer` (the `space` binary); a gzip-compressed archive
/// is decompressed into `partial/work` (removed after). Steps go to
/// `progress`, the child's log lines and failure to `log`.
pub fn import(
    importer: &Path,
    partial: &Path,
    archive: &fs::File,
    log: &fs::File,
    max_bytes: Option<u64>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Imported, HostError> {
    import_as(Archive::Oci, importer, partial, archive, log, max_bytes, progress)
}

/// What an archive the child reads is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Archive<'a> {
    /// An OCI image (`docker save` or an OCI layout tar).
    Oci,
    /// A template's root as another node of a cluster exported it (a plain
    /// tar of the root, `space_host::template::write_root_tar`).
    RootTar,
    /// One layer blob (gzip, zstd or plain) onto the root, which holds the
    /// layers below it: a layer chain of the cache.
    Layer { digest: Option<&'a BlobDigest>, diff_id: Option<&'a BlobDigest> },
}

/// [`import`] of one layer blob onto `partial/rootfs`: its bytes are
/// checked against `digest` and `diff_id`, where given, by the confined
/// child, which answers with the blob's size.
pub fn import_layer(
    importer: &Path,
    partial: &Path,
    blob: &fs::File,
    digest: Option<&BlobDigest>,
    diff_id: Option<&BlobDigest>,
    log: &fs::File,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<u64, HostError> {
    let imported = import_as(Archive::Layer { digest, diff_id }, importer, partial, blob, log, None, progress)?;
    imported
        .source
        .get("blob_bytes")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| child_failed("the importer's result of a layer lacks its size".into()))
}

/// [`import`] of another node's export of a template root: the same
/// confined child, applying a plain tar (a peer's bytes are parsed as
/// little as a tenant's are).
pub fn import_root_tar(
    importer: &Path,
    partial: &Path,
    archive: &fs::File,
    log: &fs::File,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<(), HostError> {
    import_as(Archive::RootTar, importer, partial, archive, log, None, progress).map(drop)
}

fn import_as(
    kind: Archive<'_>,
    importer: &Path,
    partial: &Path,
    archive: &fs::File,
    log: &fs::File,
    max_bytes: Option<u64>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Imported, HostError> {
    let work = partial.join("work");
    fs::create_dir(&work).map_err(HostError::io("creating the importer's work dir"))?;
    let result = run_child(kind, importer, partial, archive, log, max_bytes, progress);
    let _ = fs::remove_dir_all(&work);
    if let Err(ChildError::Parent(err)) = &result {
        let mut log = log;
        let _ = writeln!(log, "import failed: {err}");
    }
    result.map_err(ChildError::into_host)
}

enum ChildError {
    /// Told by the child (and written to the log by it).
    Child(HostError),
    /// Found by the parent: the child could not start, died or misbehaved.
    Parent(HostError),
}

impl ChildError {
    fn into_host(self) -> HostError {
        match self {
            ChildError::Child(err) | ChildError::Parent(err) => err,
        }
    }
}

fn run_child(
    kind: Archive<'_>,
    importer: &Path,
    partial: &Path,
    archive: &fs::File,
    log: &fs::File,
    max_bytes: Option<u64>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Imported, ChildError> {
    let parent = |err| ChildError::Parent(err);
    let starting = |source| HostError::Io {
        what: format!("starting the importer {} (only it parses image archives)", importer.display()),
        source,
    };
    // Checked before the spawn: std's spawn waits for a child whose exec
    // failed, and the process-wide reaper may have taken that status first.
    match fs::metadata(importer) {
        Ok(meta) if meta.is_file() => {}
        Ok(_) => return Err(parent(starting(io::Error::from(io::ErrorKind::InvalidInput)))),
        Err(err) => return Err(parent(starting(err))),
    }
    let (reports, child_end) = UnixStream::pair()
        .map_err(|source| parent(HostError::Io { what: "a socket for the importer".into(), source }))?;
    let dup = |file: &fs::File, what: &str| file.try_clone().map_err(HostError::io(format!("passing the {what}")));
    let mut command = Command::new(importer);
    command
        .arg(SUBCOMMAND)
        .arg("--build-dir")
        .arg(partial)
        .args(max_bytes.map(|max| format!("--max-bytes={max}")))
        .args((kind == Archive::RootTar).then_some("--root-tar"))
        .args(match kind {
            Archive::Layer { digest, diff_id } => {
                let mut args = vec!["--layer".to_string()];
                args.extend(digest.map(|digest| format!("--layer-digest={digest}")));
                args.extend(diff_id.map(|diff_id| format!("--diff-id={diff_id}")));
                args
            }
            _ => Vec::new(),
        })
        .env_clear()
        .current_dir("/")
        .stdin(dup(archive, "archive").map_err(parent)?)
        .stdout(Stdio::from(std::os::fd::OwnedFd::from(child_end)))
        .stderr(dup(log, "log").map_err(parent)?);
    // SAFETY: between fork and exec this only calls prctl, which is
    // async-signal-safe and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            // A child outliving its parent would go on writing into a
            // build dir a restarted helper may make anew.
            if nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = Reaper::global().spawn(&mut command).map_err(|source| parent(starting(source)))?;
    // Closes this process's copy of the child's end, so that the child's
    // exit is the end of the reports.
    drop(command);
    let outcome = read_reports(&child, reports, progress);
    // A child that misbehaved is stopped at once; one done gets a moment to exit.
    let patience = if outcome.is_err() { Duration::ZERO } else { EXIT_PATIENCE };
    // The status is taken once: until it is, the child is not reaped and
    // its pid cannot be another process's.
    let status = child.wait_timeout(patience).unwrap_or_else(|| {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::SIGKILL);
        child.wait()
    });
    let imported = outcome?;
    match (imported, status) {
        (Some(imported), ExitStatus::Exited(0)) => Ok(imported),
        (Some(_), status) => Err(parent(child_failed(format!("the importer ended {} after its result", said(status))))),
        (None, status) => Err(parent(child_failed(format!(
            "the importer ended {} without a result (what it wrote is in the build log)",
            said(status)
        )))),
    }
}

/// How a child ended, in words.
fn said(status: ExitStatus) -> String {
    match status {
        ExitStatus::Exited(code) => format!("with exit code {code}"),
        // SIGSYS: a system call its seccomp filter kills for (another
        // architecture's).
        ExitStatus::Signaled(signal) if signal == nix::libc::SIGSYS => {
            format!("killed by signal {signal} (SIGSYS: its seccomp filter)")
        }
        ExitStatus::Signaled(signal) => format!("killed by signal {signal}"),
    }
}

/// Reads the child's reports until its stdout closes: its result (`None`
/// when it ended without one), its failure, or a misbehaviour.
fn read_reports(
    child: &ReapedChild,
    mut stdout: UnixStream,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Option<Imported>, ChildError> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let parent = |message: String| ChildError::Parent(child_failed(message));
    let mut pending: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    let mut confined = false;
    let mut result = None;
    let mut heard = Instant::now();
    loop {
        let mut fds = [PollFd::new(stdout.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(1000u16)) {
            Ok(0) => {
                if heard.elapsed() > SILENCE_PATIENCE {
                    return Err(parent(format!("the importer reported nothing for {}s", SILENCE_PATIENCE.as_secs())));
                }
                continue;
            }
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(err) => return Err(parent(format!("waiting for the importer: {err}"))),
        }
        let read = match stdout.read(&mut chunk) {
            // A reset is an end too: the child closed its end without
            // reading the go-ahead.
            Ok(0) => break,
            Err(err) if err.kind() == io::ErrorKind::ConnectionReset => break,
            Ok(read) => read,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(parent(format!("reading the importer's reports: {err}"))),
        };
        heard = Instant::now();
        pending.extend_from_slice(&chunk[..read]);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let report: Report = serde_json::from_slice(&line)
                .map_err(|err| parent(format!("the importer sent a report that does not parse: {err}")))?;
            if result.is_some() {
                return Err(parent("the importer reported after its result".into()));
            }
            match report {
                // Before it is confined it has read nothing of the archive:
                // nothing can be the archive's fault.
                Report::Failed { invalid, message } => {
                    let err = if invalid && confined { HostError::Invalid(message) } else { child_failed(message) };
                    return Err(ChildError::Child(err));
                }
                Report::Confined { landlock } if !confined => {
                    check_confined(child.id(), "the importer").map_err(parent)?;
                    tracing::debug!(pid = child.id(), landlock, "the importer is confined");
                    confined = true;
                    stdout.write_all(b"\n").map_err(|err| parent(format!("answering the importer: {err}")))?;
                }
                _ if !confined => return Err(parent("the importer reported before it was confined".into())),
                Report::Confined { .. } => return Err(parent("the importer reported its confinement twice".into())),
                Report::Progress { step, done, bytes } => progress(checked_progress(step, done, bytes)),
                Report::Imported { imported } => result = Some(imported),
            }
        }
        if pending.len() > MAX_REPORT {
            return Err(parent(format!("the importer sent a report longer than {MAX_REPORT} bytes")));
        }
    }
    Ok(result)
}

/// The child's report of a step, bounded as the parent's own would be.
fn checked_progress(step: String, done: u64, bytes: Option<[u64; 2]>) -> BuildProgress {
    let step: String = step.chars().take(200).collect();
    let done = done.min(space_host::template::BUILD_STEPS);
    match bytes {
        Some([bytes_done, total]) => BuildProgress::bytes(&step, done, bytes_done, total),
        None => BuildProgress::step(&step, done),
    }
}

/// Checks from outside, once the child says it is confined, that it holds
/// no more than it should (what it dropped it can never regain): a binary
/// that confines itself less (an old or wrong `space`) is stopped and the
/// build fails. The volume files child is held to the same (`what` names
/// the child in the message).
pub(crate) fn check_confined(pid: u32, what: &str) -> Result<(), String> {
    let status = confine::status_of(pid).map_err(|err| format!("reading {what}'s status: {err}"))?;
    let kept = confine::capability_mask(&KEPT_CAPABILITIES);
    let extra = (status.cap_effective
        | status.cap_permitted
        | status.cap_bounding
        | status.cap_inheritable
        | status.cap_ambient)
        & !kept;
    if extra != 0
        || status.cap_inheritable != 0
        || status.cap_ambient != 0
        || !status.no_new_privs
        || status.seccomp != 2
    {
        return Err(format!(
            "{what} is not confined as it must be: {status:?} (only capabilities {kept:#x} may be kept)"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The child's side.

/// The arguments of [`SUBCOMMAND`].
#[derive(Debug, Clone)]
pub struct ChildArgs {
    /// The build dir: the child's root, holding `rootfs` and `work`.
    pub build_dir: PathBuf,
    pub max_bytes: Option<u64>,
    /// The archive is a template root another node exported, not an image.
    pub root_tar: bool,
    /// The archive is one layer blob, not an image.
    pub layer: bool,
    /// The layer blob's digest (`sha256:…`), when it is known.
    pub layer_digest: Option<String>,
    /// The layer's uncompressed digest, when its image names it.
    pub diff_id: Option<String>,
}

/// The child: confines itself, imports the archive on its stdin into the
/// build dir, reports on its stdout. Call it first thing in `main`, with
/// no other thread started. Returns the process's exit code.
pub fn child_main(args: &ChildArgs) -> i32 {
    let (archive, log) = match (dup_std(io::stdin().as_fd()), dup_std(io::stderr().as_fd())) {
        (Ok(archive), Ok(log)) => (archive, log),
        (Err(err), _) | (_, Err(err)) => {
            report(&Report::Failed { invalid: false, message: format!("taking the archive and the log: {err}") });
            return 1;
        }
    };
    let keeping = Keeping {
        capabilities: KEPT_CAPABILITIES.to_vec(),
        writable: vec![args.build_dir.join("rootfs"), args.build_dir.join("work")],
        root: Some(args.build_dir.clone()),
        no_new_processes: true,
        threads: false,
    };
    let confined = match confine::confine_keeping(&keeping) {
        Ok(confined) if confined.missing.is_empty() => confined,
        Ok(confined) => {
            let message = format!("the build dir lacks {:?}", confined.missing);
            let _ = writeln!(&log, "import failed: {message}");
            report(&Report::Failed { invalid: false, message });
            return 1;
        }
        Err(err) => {
            let message = format!("confining the importer: {err}");
            let _ = writeln!(&log, "import failed: {message}");
            report(&Report::Failed { invalid: false, message });
            return 1;
        }
    };
    report(&Report::Confined { landlock: format!("{:?}", confined.landlock) });
    // Nothing of the archive is read before the parent has seen this
    // process confined; a parent gone (EOF) ends it.
    let mut go = [0u8; 1];
    let answered = io::stdout().as_fd().try_clone_to_owned().and_then(|fd| fs::File::from(fd).read(&mut go));
    if !matches!(answered, Ok(1)) {
        return 1;
    }
    let mut progress = |step: BuildProgress| {
        let bytes = step.amount.map(|amount| [amount.done, amount.total]);
        report(&Report::Progress { step: step.step, done: step.done, bytes });
    };
    let rootfs = Path::new(ROOTFS_INSIDE);
    let work = Path::new(WORK_INSIDE);
    let extracted = match (args.layer, args.root_tar) {
        (true, _) => apply_one_layer(
            rootfs,
            &archive,
            args.layer_digest.as_deref(),
            args.diff_id.as_deref(),
            &log,
            &mut progress,
        ),
        (false, true) => space_host::template::extract_root_tar(rootfs, &archive, &log, &mut progress)
            .map(|()| Imported { source: serde_json::Value::Null, defaults: Default::default() }),
        (false, false) => space_host::oci::extract_oci(rootfs, work, &archive, &log, args.max_bytes, &mut progress),
    };
    match extracted {
        Ok(imported) => {
            report(&Report::Imported { imported });
            0
        }
        Err(HostError::Invalid(message)) => {
            report(&Report::Failed { invalid: true, message });
            1
        }
        Err(err) => {
            report(&Report::Failed { invalid: false, message: err.to_string() });
            1
        }
    }
}

/// The child's work of [`import_layer`]: its result names the layer's
/// digests and the blob's size.
fn apply_one_layer(
    rootfs: &Path,
    blob: &fs::File,
    digest: Option<&str>,
    diff_id: Option<&str>,
    log: &fs::File,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Imported, HostError> {
    let mut log = log;
    let expected = space_host::oci::LayerDigests { blob: digest, diff_id };
    let digest = digest.unwrap_or("(a build step's)");
    let step = format!("applying layer {digest}");
    // The blob is a file the parent opened (a pipe would say 0).
    let total = blob.metadata().map(|meta| meta.len()).unwrap_or(0);
    progress(BuildProgress::bytes(&step, 2, 0, total));
    let applied = space_host::oci::apply_blob(blob, expected, rootfs, &mut log, &mut |bytes| {
        progress(BuildProgress::bytes(&step, 2, bytes, total))
    });
    match applied {
        Ok(applied) => {
            let source = serde_json::json!({
                "blob_digest": applied.blob_digest,
                "diff_id": applied.diff_id,
                "blob_bytes": applied.blob_bytes,
            });
            Ok(Imported { source, defaults: Default::default() })
        }
        Err(err) => {
            let _ = writeln!(log, "layer {digest} failed: {err}");
            Err(err)
        }
    }
}

fn dup_std(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<fs::File> {
    Ok(fs::File::from(fd.try_clone_to_owned()?))
}

/// One report line; a parent gone is the end of the child's work anyway.
fn report(report: &Report) {
    let mut line = serde_json::to_vec(report).unwrap_or_default();
    line.push(b'\n');
    let mut stdout = io::stdout().lock();
    let _ = stdout.write_all(&line).and_then(|()| stdout.flush());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_unknown_fields_are_refused() {
        let progress = Report::Progress { step: "applying layer 1 of 2".into(), done: 2, bytes: Some([1, 9]) };
        let line = serde_json::to_string(&progress).unwrap();
        assert!(matches!(serde_json::from_str(&line).unwrap(), Report::Progress { done: 2, .. }));
        assert!(serde_json::from_str::<Report>(r#"{"report":"confined","landlock":"Full","extra":1}"#).is_err());
        let bounded = checked_progress("x".repeat(10_000), 99, Some([5, 3]));
        assert_eq!((bounded.step.len(), bounded.done), (200, space_host::template::BUILD_STEPS));
        assert_eq!(bounded.amount.map(|a| (a.done, a.total)), Some((3, 3)));
    }

    #[test]
    fn the_kept_capabilities_are_the_file_owning_four() {
        assert_eq!(confine::capability_mask(&KEPT_CAPABILITIES), 0x1b);
    }
}
