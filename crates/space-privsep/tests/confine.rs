//! `confine()` applied to a real process: each case runs in a child (this
//! binary again, told which case by an environment variable), which
//! confines itself, tries what a compromised process would, and reports
//! `key=value` lines that the parent checks.
//!
//! This test is its own `main` (no libtest harness): confinement refuses
//! a process with more than one thread, and the harness runs each test on
//! a thread of its own.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::libc;
use space_privsep::confine::{self, Confinement};

const CASE_ENV: &str = "SPACE_PRIVSEP_CONFINE_CASE";
const DIR_ENV: &str = "SPACE_PRIVSEP_CONFINE_DIR";
const NOBODY: u32 = 65534;
const DEADLINE: Duration = Duration::from_secs(20);

/// One check, run by the parent.
type Case = fn() -> Result<(), String>;

fn main() -> ExitCode {
    if let Ok(case) = std::env::var(CASE_ENV) {
        child(&case, Path::new(&std::env::var(DIR_ENV).expect("the scratch dir")));
        return ExitCode::SUCCESS;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let names: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let cases: [(&str, Case); 4] = [
        ("a_confined_process_keeps_no_privilege", confined_root),
        ("a_confined_process_switched_to_nobody_keeps_no_privilege", confined_nobody),
        ("without_confinement_the_same_attempts_succeed", unconfined_control),
        ("confinement_refuses_a_process_with_threads", threads_refused),
    ];
    // The listing libtest gives (`--list --format terse`), which the test
    // runner reads to run each case as a process of its own; none is ignored.
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
    let cases = cases.into_iter().filter(|(name, _)| chosen(name));
    let (mut passed, mut failed) = (0, 0);
    for (name, case) in cases {
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

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `allowed/` (the confinement's one writable path) and `forbidden/`, each
/// with a file, in a directory every uid may enter; removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str, owner: Option<u32>) -> Scratch {
        let dir = std::env::temp_dir().join(format!("space-privsep-confine-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["allowed", "forbidden"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
            std::fs::write(dir.join(sub).join("file"), "text").unwrap();
            std::fs::set_permissions(dir.join(sub), std::fs::Permissions::from_mode(0o777)).unwrap();
            std::fs::set_permissions(dir.join(sub).join("file"), std::fs::Permissions::from_mode(0o666)).unwrap();
            if let Some(uid) = owner {
                std::os::unix::fs::chown(dir.join(sub), Some(uid), Some(uid)).unwrap();
            }
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `case` in a child and returns its report.
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

fn expect(report: &BTreeMap<String, String>, key: &str, want: &str) -> Result<(), String> {
    match report.get(key) {
        Some(got) if got == want => Ok(()),
        got => Err(format!("{key}: wanted {want}, got {got:?} (report: {report:?})")),
    }
}

/// What every confined child must report.
fn expect_confined(report: &BTreeMap<String, String>) -> Result<(), String> {
    expect(report, "confine", "ok")?;
    expect(report, "CapEff", "0")?;
    expect(report, "CapPrm", "0")?;
    expect(report, "CapInh", "0")?;
    expect(report, "CapAmb", "0")?;
    expect(report, "NoNewPrivs", "1")?;
    expect(report, "Seccomp", "2")?;
    expect(report, "landlock", "Full")?;
    // Without CAP_SYS_ADMIN and denied by the filter.
    expect(report, "mount", "EPERM")?;
    // Allowed to an unprivileged user by the kernel: the filter alone refuses.
    expect(report, "unshare_user", "EPERM")?;
    expect(report, "clone_user", "EPERM")?;
    expect(report, "clone3", "ENOSYS")?;
    expect(report, "io_uring_setup", "EPERM")?;
    // Landlock: nothing outside the confinement's paths.
    expect(report, "read_forbidden", "EACCES")?;
    expect(report, "read_etc", "EACCES")?;
    expect(report, "write_allowed", "ok")?;
    expect(report, "read_allowed", "ok")
}

fn confined_root() -> Result<(), String> {
    let scratch = Scratch::new("root", None);
    let report = run_child("confine", &scratch.0)?;
    expect_confined(&report)?;
    if is_root() {
        expect(&report, "CapBnd", "0")?;
        expect(&report, "bounding_set_emptied", "true")?;
    } else {
        eprintln!("NOTE: not root, so the bounding set could not be emptied and is not checked");
    }
    Ok(())
}

fn confined_nobody() -> Result<(), String> {
    if !is_root() {
        eprintln!("SKIPPED a_confined_process_switched_to_nobody_keeps_no_privilege: it needs root to switch user");
        return Ok(());
    }
    let scratch = Scratch::new("nobody", Some(NOBODY));
    let report = run_child("confine-nobody", &scratch.0)?;
    expect_confined(&report)?;
    expect(&report, "CapBnd", "0")?;
    expect(&report, "uid", &NOBODY.to_string())
}

/// The same attempts from a child that does not confine itself: each of
/// the refusals above is the confinement's doing, not the host's.
fn unconfined_control() -> Result<(), String> {
    let scratch = Scratch::new("control", None);
    let report = run_child("unconfined", &scratch.0)?;
    expect(&report, "NoNewPrivs", "0")?;
    expect(&report, "Seccomp", "0")?;
    expect(&report, "unshare_user", "ok")?;
    expect(&report, "clone_user", "ok")?;
    expect(&report, "read_forbidden", "ok")?;
    expect(&report, "read_etc", "ok")
}

fn threads_refused() -> Result<(), String> {
    let scratch = Scratch::new("threads", None);
    let report = run_child("threads", &scratch.0)?;
    let said = report.get("confine").cloned().unwrap_or_default();
    if said.contains("before any thread is started") {
        Ok(())
    } else {
        Err(format!("confine with two threads said {said:?}"))
    }
}

// ---------------------------------------------------------------------------
// The child's side.

fn child(case: &str, dir: &Path) {
    let allowed = dir.join("allowed");
    let confinement = Confinement {
        read_write: vec![allowed.clone()],
        read_only: Vec::new(),
        user: (case == "confine-nobody").then_some((NOBODY, NOBODY)),
        require_full_landlock: false,
    };
    match case {
        "confine" | "confine-nobody" => match confine::confine(&confinement) {
            Ok(done) => {
                println!("confine=ok");
                println!("landlock={:?}", done.landlock);
                println!("bounding_set_emptied={}", done.bounding_set_emptied);
            }
            Err(err) => {
                println!("confine={err}");
                return;
            }
        },
        "unconfined" => {}
        "threads" => {
            let (_tx, rx) = std::sync::mpsc::channel::<()>();
            let _thread = std::thread::spawn(move || rx.recv());
            match confine::confine(&confinement) {
                Ok(_) => println!("confine=ok"),
                Err(err) => println!("confine={err}"),
            }
            return;
        }
        other => panic!("no case {other}"),
    }
    let status = confine::status().expect("the thread's status");
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
    let said = |result: Result<(), Errno>| match result {
        Ok(()) => "ok".to_string(),
        Err(errno) => format!("{errno:?}"),
    };
    let mount = nix::mount::mount(Some("tmpfs"), &allowed, Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>);
    if mount.is_ok() {
        let _ = nix::mount::umount(&allowed);
    }
    println!("mount={}", said(mount));
    // In a child of its own, so that a namespace made does not change this
    // process for the attempts after it.
    println!("unshare_user={}", said(in_fork(|| nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER))));
    println!("clone_user={}", said(clone_newuser()));
    println!("clone3={}", said(clone3_probe()));
    println!("io_uring_setup={}", said(io_uring_probe()));
    let read = |path: PathBuf| said(std::fs::read(path).map(drop).map_err(io_errno));
    println!("read_forbidden={}", read(dir.join("forbidden/file")));
    println!("read_etc={}", read(PathBuf::from("/etc/hostname")));
    println!("read_allowed={}", read(allowed.join("file")));
    println!("write_allowed={}", said(std::fs::write(allowed.join("new"), "x").map_err(io_errno)));
}

fn io_errno(err: std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(0))
}

/// Runs `attempt` in a forked child and reports its result.
fn in_fork(attempt: impl FnOnce() -> nix::Result<()>) -> nix::Result<()> {
    // SAFETY: this process has one thread (the harness is ours); the child
    // makes one system call and exits without returning into Rust code.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            let code = match attempt() {
                Ok(()) => 0,
                Err(errno) => errno as i32,
            };
            // SAFETY: _exit ends the forked child at once.
            unsafe { libc::_exit(code) }
        }
        nix::unistd::ForkResult::Parent { child } => wait_code(child),
    }
}

fn wait_code(child: nix::unistd::Pid) -> nix::Result<()> {
    match nix::sys::wait::waitpid(child, None)? {
        nix::sys::wait::WaitStatus::Exited(_, 0) => Ok(()),
        nix::sys::wait::WaitStatus::Exited(_, code) => Err(Errno::from_raw(code)),
        other => panic!("the probe child ended {other:?}"),
    }
}

/// `clone(CLONE_NEWUSER)` itself, as `unshare` would not show the filter's
/// rule on clone's flags.
fn clone_newuser() -> nix::Result<()> {
    let flags = (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a fork-like clone (no CLONE_VM, no new stack): the child runs
    // on a copy of this stack and exits at once.
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    match pid {
        -1 => Err(Errno::last()),
        // SAFETY: _exit ends the cloned child at once.
        0 => unsafe { libc::_exit(0) },
        pid => wait_code(nix::unistd::Pid::from_raw(pid as i32)),
    }
}

/// clone3 with no arguments: EFAULT/EINVAL from the kernel, ENOSYS from
/// the filter.
fn clone3_probe() -> nix::Result<()> {
    // SAFETY: a null argument with size 0 makes no process; the kernel
    // refuses it.
    let done = unsafe { libc::syscall(libc::SYS_clone3, std::ptr::null::<libc::c_void>(), 0usize) };
    if done == -1 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}

/// io_uring_setup with a null params pointer: EFAULT from the kernel,
/// EPERM from the filter.
fn io_uring_probe() -> nix::Result<()> {
    // SAFETY: a null params pointer; the kernel refuses it before using it.
    let done = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, std::ptr::null::<libc::c_void>()) };
    if done == -1 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}
