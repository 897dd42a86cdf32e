//! `confine_keeping()` applied to a real root process, as the template
//! importer child applies it: the child (this binary again, told its case
//! by an environment variable) confines itself to a build dir, then does
//! what a compromised importer would — writes, renames, chmods and
//! executes outside what it was given, by plain paths and through links
//! it made itself, so with none of the extractor's own checks — and reports
//! `key=value` lines the parent checks. A control child makes the same
//! attempts unconfined, and they succeed.
//!
//! Its own `main` (no libtest harness), as `confine.rs`: confinement
//! refuses a process with more than one thread.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use space_privsep::confine::{self, cap, Keeping};

const CASE_ENV: &str = "SPACE_PRIVSEP_KEEPING_CASE";
const DIR_ENV: &str = "SPACE_PRIVSEP_KEEPING_DIR";
const DEADLINE: Duration = Duration::from_secs(20);
/// The importer's four, as `/proc/PID/status` shows them.
const KEPT_MASK: &str = "1b";

type Case = fn() -> Result<(), String>;

fn main() -> ExitCode {
    if let Ok(case) = std::env::var(CASE_ENV) {
        child(&case, Path::new(&std::env::var(DIR_ENV).expect("the scratch dir")));
        return ExitCode::SUCCESS;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let names: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let cases: [(&str, Case); 3] = [
        ("a_kept_root_process_holds_its_four_capabilities_and_its_build_dir_alone", kept),
        ("a_kept_process_allowed_threads_starts_threads_but_no_process", threads),
        ("without_confinement_the_same_attempts_succeed", control),
    ];
    if flag("--list") {
        if !flag("--ignored") {
            cases.iter().for_each(|(name, _)| println!("{name}: test"));
        }
        return ExitCode::SUCCESS;
    }
    let chosen = |name: &str| {
        names.is_empty()
            || names.iter().any(|n| if flag("--exact") { n.as_str() == name } else { name.contains(n.as_str()) })
    };
    let (mut passed, mut failed) = (0, 0);
    for (name, case) in cases.into_iter().filter(|(name, _)| chosen(name)) {
        match case() {
            Ok(()) => {
                println!("test {name} ... ok");
                passed += 1;
            }
            Err(why) => {
                println!("test {name} ... FAILED\n  {why}");
                failed += 1;
            }
        }
    }
    println!(
        "\ntest result: {}. {passed} passed; {failed} failed; 0 ignored; 0 measured; 0 filtered out",
        if failed == 0 { "ok" } else { "FAILED" }
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `build/{rootfs,work}` (what the importer may write), a file at the
/// build dir's top (which it may not), and `outside/` beside the build dir.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("space-privsep-keeping-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["build/rootfs", "build/work", "outside"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        std::fs::write(dir.join("outside/file"), "host's").unwrap();
        std::fs::set_permissions(dir.join("outside/file"), std::fs::Permissions::from_mode(0o644)).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run_child(case: &str, dir: &Path) -> Result<BTreeMap<String, String>, String> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(CASE_ENV, case)
        .env(DIR_ENV, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("the child of case {case} did not end within {DEADLINE:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("the child of case {case} ended {status}: {out}"));
    }
    Ok(out.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

fn expect_all(report: &BTreeMap<String, String>, wanted: &[(&str, &str)]) -> Result<(), String> {
    let wrong: Vec<String> = wanted
        .iter()
        .filter(|(key, want)| report.get(*key).map(String::as_str) != Some(want))
        .map(|(key, want)| format!("{key}: wanted {want}, got {:?}", report.get(*key)))
        .collect();
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(format!("{} (report: {report:?})", wrong.join("; ")))
    }
}

fn kept() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("this test confines a root process: run it as root".into());
    }
    let scratch = Scratch::new("kept");
    let report = run_child("kept", &scratch.0)?;
    expect_all(
        &report,
        &[
            ("confine", "ok"),
            ("missing", "0"),
            ("uid", "0"),
            ("CapEff", KEPT_MASK),
            ("CapPrm", KEPT_MASK),
            ("CapBnd", KEPT_MASK),
            ("CapInh", "0"),
            ("CapAmb", "0"),
            ("NoNewPrivs", "1"),
            ("Seccomp", "2"),
            ("landlock", "Full"),
            // What extracting a layer needs, beneath the root and the work dir.
            ("write_rootfs", "ok"),
            ("write_work", "ok"),
            ("chown_rootfs", "ok"),
            ("setuid_rootfs", "ok"),
            // The build dir's own entries: Landlock.
            ("write_build_top", "EACCES"),
            // A host path does not exist in its root, by name or through a link.
            ("write_host_path", "ENOENT"),
            ("chmod_host_path", "ENOENT"),
            ("write_through_link_to_host", "ENOENT"),
            // `..` out of its root stays in it, and the top is not writable.
            ("write_dotdot", "EACCES"),
            // What it wrote it cannot run, and it starts nothing.
            ("exec_written", "EACCES"),
            ("fork", "EPERM"),
            ("thread", "EPERM"),
            ("mount", "EPERM"),
            ("unshare_user", "EPERM"),
            ("chroot", "EPERM"),
            ("rename_rootfs", "EACCES"),
        ],
    )?;
    let host_file = scratch.0.join("outside/file");
    let mode = std::fs::metadata(&host_file).map_err(|e| e.to_string())?.permissions().mode() & 0o7777;
    if mode != 0o644 || std::fs::read_to_string(&host_file).map_err(|e| e.to_string())? != "host's" {
        return Err(format!("the host's file changed: mode {mode:o}"));
    }
    Ok(())
}

/// The same attempts by a root process that does not confine itself:
/// each refusal above is the confinement's doing.
fn control() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("this test compares with a root process: run it as root".into());
    }
    let scratch = Scratch::new("control");
    let report = run_child("control", &scratch.0)?;
    expect_all(
        &report,
        &[
            ("write_rootfs", "ok"),
            ("write_build_top", "ok"),
            ("write_host_path", "ok"),
            ("chmod_host_path", "ok"),
            ("write_through_link_to_host", "ok"),
            ("exec_written", "ENOEXEC"),
            ("fork", "ok"),
            ("thread", "ok"),
            ("rename_rootfs", "ok"),
        ],
    )
}

/// The volume files child's confinement: the same, but threads of its
/// own are let through (its file code runs on them); a new process is not.
fn threads() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("this test confines a root process: run it as root".into());
    }
    let scratch = Scratch::new("threads");
    let report = run_child("threads", &scratch.0)?;
    expect_all(
        &report,
        &[
            ("confine", "ok"),
            ("CapEff", KEPT_MASK),
            ("NoNewPrivs", "1"),
            ("Seccomp", "2"),
            ("write_rootfs", "ok"),
            ("write_host_path", "ENOENT"),
            ("thread", "ok"),
            ("fork", "EPERM"),
            ("exec_written", "EACCES"),
        ],
    )
}

// ---------------------------------------------------------------------------
// The child's side.

fn child(case: &str, dir: &Path) {
    let host_build = dir.join("build");
    let outside = dir.join("outside");
    // Where the build dir is as this process sees it: its root once confined.
    // Its status, opened while /proc is still in its root (read after).
    let mut status_file = std::fs::File::open("/proc/self/status").expect("this process's status");
    let build = match case {
        "kept" | "threads" => {
            let keeping = Keeping {
                capabilities: vec![cap::CHOWN, cap::DAC_OVERRIDE, cap::FOWNER, cap::FSETID],
                writable: vec![host_build.join("rootfs"), host_build.join("work")],
                root: Some(host_build.clone()),
                no_new_processes: true,
                threads: case == "threads",
            };
            match confine::confine_keeping(&keeping) {
                Ok(done) => {
                    println!("confine=ok");
                    println!("landlock={:?}", done.landlock);
                    println!("missing={}", done.missing.len());
                }
                Err(err) => {
                    println!("confine={err}");
                    return;
                }
            }
            PathBuf::from("/")
        }
        "control" => host_build,
        other => panic!("no case {other}"),
    };
    let mut text = String::new();
    let _ = std::io::Read::read_to_string(&mut status_file, &mut text);
    if let Ok(status) = confine::parse_status(&text) {
        println!("uid={}", status.uid);
        for (key, value) in [
            ("CapEff", status.cap_effective),
            ("CapPrm", status.cap_permitted),
            ("CapInh", status.cap_inheritable),
            ("CapBnd", status.cap_bounding),
            ("CapAmb", status.cap_ambient),
        ] {
            println!("{key}={value:x}");
        }
        println!("NoNewPrivs={}", u8::from(status.no_new_privs));
        println!("Seccomp={}", status.seccomp);
    }
    let said = |result: Result<(), Errno>| match result {
        Ok(()) => "ok".to_string(),
        Err(errno) => format!("{errno:?}"),
    };
    let io = |result: std::io::Result<()>| said(result.map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(0))));
    let rootfs = build.join("rootfs");
    println!("write_rootfs={}", io(std::fs::write(rootfs.join("new"), "layer")));
    println!("write_work={}", io(std::fs::write(build.join("work/image.tar"), "copy")));
    println!("chown_rootfs={}", io(std::os::unix::fs::chown(rootfs.join("new"), Some(1000), Some(1000))));
    println!(
        "setuid_rootfs={}",
        io(std::fs::set_permissions(rootfs.join("new"), std::fs::Permissions::from_mode(0o4755)))
    );
    println!("write_build_top={}", io(std::fs::write(build.join("top"), "x")));
    println!("write_host_path={}", io(std::fs::write(outside.join("new"), "x")));
    println!(
        "chmod_host_path={}",
        io(std::fs::set_permissions(outside.join("file"), std::fs::Permissions::from_mode(0o4777)))
    );
    let link = rootfs.join("to-host");
    let linked = std::os::unix::fs::symlink(&outside, &link).and_then(|()| std::fs::write(link.join("linked"), "x"));
    println!("write_through_link_to_host={}", io(linked));
    let program = rootfs.join("program");
    let exec = std::fs::write(&program, b"\x7fELF not really")
        .and_then(|()| std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)))
        .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(0)))
        .and_then(|()| {
            let path = std::ffi::CString::new(program.as_os_str().as_encoded_bytes()).unwrap();
            nix::unistd::execv(&path, &[&path]).map(drop)
        });
    println!("exec_written={}", said(exec));
    println!("fork={}", said(fork_and_reap()));
    let thread = std::thread::Builder::new()
        .spawn(|| ())
        .and_then(|handle| handle.join().map_err(|_| std::io::Error::other("the thread panicked")));
    println!("thread={}", io(thread));
    let mount = nix::mount::mount(Some("tmpfs"), &rootfs, Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>);
    if mount.is_ok() {
        let _ = nix::mount::umount(&rootfs);
    }
    println!("mount={}", said(mount));
    if case == "kept" {
        // In the control these would change this very process or write
        // at the host's root.
        println!("write_dotdot={}", io(std::fs::write(rootfs.join("../../../../../../dotdot"), "x")));
        println!("unshare_user={}", said(nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER)));
        println!("chroot={}", said(nix::unistd::chroot("/")));
    }
    println!("rename_rootfs={}", io(std::fs::rename(&rootfs, build.join("moved"))));
}

/// A forked child that exits at once.
fn fork_and_reap() -> nix::Result<()> {
    // SAFETY: this process has one thread (the harness is ours); the child
    // exits at once without returning into Rust code.
    match unsafe { nix::unistd::fork() }? {
        // SAFETY: _exit ends the forked child at once.
        nix::unistd::ForkResult::Child => unsafe { nix::libc::_exit(0) },
        nix::unistd::ForkResult::Parent { child } => nix::sys::wait::waitpid(child, None).map(drop),
    }
}
