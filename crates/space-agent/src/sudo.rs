//! `sudo` that works where setuid does not (decision 034).
//!
//! gVisor never honours set-user-ID bits (every process behaves as if it
//! had `no_new_privs`), so a root's `/usr/bin/sudo` cannot raise anyone's
//! privileges there. The agent runs as root in the sandbox anyway; it
//! serves [`SOCKET`], and `space-agent sudo` (installed as
//! `/usr/local/bin/sudo`, a link to the agent, ahead of `/usr/bin` on
//! `PATH`) asks it to run a command: it passes its own stdin, stdout and
//! stderr (`SCM_RIGHTS`), argv, environment and working directory, forwards
//! the signals it gets, and exits with the command's status.
//!
//! The agent decides by the caller's credentials as the kernel vouches for
//! them (`SCM_CREDENTIALS` sent with the request, which the kernel checks
//! against the sender; gVisor's `SO_PEERCRED` gives the asker's own), never
//! by what the caller says: root; an account in group
//! `sudo`; or one sudoers grants `NOPASSWD: ALL` (by name or `%group`) in a
//! root-owned `/etc/sudoers` or `/etc/sudoers.d/*`. Everyone else is refused
//! with sudo's message and exit status 1. The command runs in a session of
//! its own (as sudo runs it), in the caller's cgroup (so a kill of the
//! caller's command reaches it), with sudo's default environment rules.
//! Nothing of this reaches the host: it is root inside the sandbox.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal};
use nix::sys::socket::{
    recvmsg, sendmsg, setsockopt, sockopt, ControlMessage, ControlMessageOwned, MsgFlags, UnixCredentials,
};
use serde_json::{json, Value};
use space_process::{ExitStatus, Reaper};

/// Where the agent listens inside the sandbox.
pub const SOCKET: &str = "/run/space-sudo.sock";
/// Where the shim goes: ahead of Debian's `/usr/bin/sudo` on every `PATH`.
const SHIM: &str = "/usr/local/bin/sudo";
/// The agent inside every root (`space-host`'s `AGENT_PATH_IN_ROOT`).
const AGENT_IN_ROOT: &str = "/.space/space-agent";
/// Debian's `secure_path`: the `PATH` every sudo command gets.
const SECURE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// What sudo keeps of the caller's environment unless `-E` (Debian's
/// `env_keep` defaults; `LC_*` too).
const ENV_KEEP: &[&str] =
    &["TERM", "COLORS", "DISPLAY", "HOSTNAME", "LS_COLORS", "XAUTHORITY", "LANG", "LANGUAGE", "LINGUAS", "TZ"];
/// The largest request the agent reads (argv and environment).
const MAX_REQUEST: usize = 4 << 20;
/// Requests still being read (not yet authorized) at once: more are
/// turned away, so no one's idle connections pile up threads in the agent.
const MAX_PENDING: usize = 64;
static PENDING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Signals the shim passes on to the command.
const FORWARDED: [Signal; 7] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
];

// ---------------------------------------------------------------- the shim

/// What the caller asked for on the command line.
#[derive(Debug, Default, PartialEq)]
struct Options {
    user: Option<String>,
    preserve_env: bool,
    keep: Vec<String>,
    login: bool,
    shell: bool,
    chdir: Option<String>,
    /// `-v`, `-k`, `-K` alone: nothing to run.
    only_validate: bool,
    command: Vec<String>,
}

const USAGE: &str = "usage: sudo [-EHknSs] [-u user] [-D directory] [--preserve-env[=list]] [--] command [arg ...]\n\
       sudo -i [-u user] [command [arg ...]]\n\
       sudo -v | -k | -K | -h | -V";

enum Parsed {
    Run(Options),
    Exit(i32),
}

/// Parses sudo's options: the ones code run in a sandbox uses; anything
/// else is refused by name rather than misread.
fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut options = Options::default();
    let mut index = 0;
    let value = |index: &mut usize, attached: &str, name: &str| -> Result<String, String> {
        if !attached.is_empty() {
            return Ok(attached.to_string());
        }
        *index += 1;
        args.get(*index).cloned().ok_or_else(|| format!("option requires an argument -- '{name}'"))
    };
    while index < args.len() {
        let arg = &args[index];
        if arg == "--" {
            index += 1;
            break;
        }
        if !arg.starts_with('-') || arg == "-" {
            break;
        }
        if let Some(long) = arg.strip_prefix("--") {
            let (name, attached) = long.split_once('=').map_or((long, None), |(n, v)| (n, Some(v)));
            match (name, attached) {
                ("user", Some(user)) => options.user = Some(user.to_string()),
                ("user", None) => options.user = Some(value(&mut index, "", "user")?),
                ("chdir", Some(dir)) => options.chdir = Some(dir.to_string()),
                ("chdir", None) => options.chdir = Some(value(&mut index, "", "chdir")?),
                ("preserve-env", None) => options.preserve_env = true,
                ("preserve-env", Some(list)) => options.keep.extend(list.split(',').map(str::to_string)),
                ("login", None) => options.login = true,
                ("shell", None) => options.shell = true,
                ("non-interactive" | "set-home" | "stdin" | "reset-timestamp" | "remove-timestamp", None) => {}
                ("prompt", Some(_)) => {}
                ("prompt", None) => drop(value(&mut index, "", "prompt")?),
                ("validate", None) => options.only_validate = true,
                ("help", None) => {
                    println!("{USAGE}");
                    return Ok(Parsed::Exit(0));
                }
                ("version", None) => {
                    println!("Sudo version 1.9 (the sandbox's agent: {})", env!("CARGO_PKG_VERSION"));
                    return Ok(Parsed::Exit(0));
                }
                _ => return Err(format!("option --{name} is not supported in this sandbox")),
            }
            index += 1;
            continue;
        }
        let flags = &arg[1..];
        for (at, flag) in flags.char_indices() {
            let rest = &flags[at + flag.len_utf8()..];
            match flag {
                'u' => {
                    options.user = Some(value(&mut index, rest, "u")?);
                    break;
                }
                'D' => {
                    options.chdir = Some(value(&mut index, rest, "D")?);
                    break;
                }
                'p' => {
                    value(&mut index, rest, "p")?;
                    break;
                }
                'E' => options.preserve_env = true,
                'i' => options.login = true,
                's' => options.shell = true,
                'n' | 'H' | 'S' | 'k' | 'K' => {}
                'v' => options.only_validate = true,
                'h' => {
                    println!("{USAGE}");
                    return Ok(Parsed::Exit(0));
                }
                'V' => {
                    println!("Sudo version 1.9 (the sandbox's agent: {})", env!("CARGO_PKG_VERSION"));
                    return Ok(Parsed::Exit(0));
                }
                other => return Err(format!("option -{other} is not supported in this sandbox")),
            }
        }
        index += 1;
    }
    options.command = args[index..].to_vec();
    if options.command.is_empty() && !options.login && !options.shell {
        if options.only_validate || args.iter().any(|a| a == "-k" || a == "-K" || a == "--reset-timestamp") {
            options.only_validate = true;
        } else {
            return Err(USAGE.to_string());
        }
    } else {
        options.only_validate = false;
    }
    Ok(Parsed::Run(options))
}

/// `space-agent sudo ARGS…` (or the agent run as `sudo`): returns the exit
/// status.
pub fn main(args: &[String]) -> i32 {
    let options = match parse(args) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Exit(code)) => return code,
        Err(message) => {
            eprintln!("sudo: {message}");
            return 1;
        }
    };
    match ask(&options) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("sudo: {message}");
            1
        }
    }
}

/// A signal's handler while it is blocked: never runs (the forwarder takes
/// the signal with `sigwait`).
extern "C" fn noted(_: libc::c_int) {}

fn ask(options: &Options) -> Result<i32, String> {
    // Caught (a background job's SIGINT is ignored otherwise, and an
    // ignored signal never waits to be taken) and blocked before any thread
    // starts, so only the forwarder takes them.
    let mut forwarded = SigSet::empty();
    for signal in FORWARDED {
        forwarded.add(signal);
        let caught = SigAction::new(SigHandler::Handler(noted), SaFlags::SA_RESTART, SigSet::empty());
        // SAFETY: the handler does nothing; it only makes the signal pending.
        unsafe { nix::sys::signal::sigaction(signal, &caught) }.map_err(|e| format!("catching {signal}: {e}"))?;
    }
    forwarded.thread_block().map_err(|e| format!("blocking signals: {e}"))?;
    let stream =
        UnixStream::connect(SOCKET).map_err(|e| format!("the sandbox's agent does not answer on {SOCKET}: {e}"))?;
    let cwd = std::env::current_dir().map(|d| d.to_string_lossy().into_owned()).unwrap_or_else(|_| "/".into());
    let env: Vec<(String, String)> = std::env::vars_os()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
        .collect();
    let request = json!({
        "command": options.command,
        "user": options.user,
        "preserve_env": options.preserve_env,
        "keep": options.keep,
        "login": options.login,
        "shell": options.shell,
        "chdir": options.chdir,
        "validate": options.only_validate,
        "cwd": cwd,
        "env": env,
    })
    .to_string();
    // A closed standard stream is passed as /dev/null.
    let null = fs::File::open("/dev/null").map_err(|e| e.to_string())?;
    let fds: Vec<RawFd> = (0..3)
        .map(|fd| if nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD).is_ok() { fd } else { null.as_raw_fd() })
        .collect();
    let mut message = (request.len() as u32).to_be_bytes().to_vec();
    message.extend_from_slice(request.as_bytes());
    let first = sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&message)],
        // The kernel checks these are the caller's own (SCM_CREDENTIALS):
        // the agent decides by them.
        &[ControlMessage::ScmRights(&fds), ControlMessage::ScmCredentials(&UnixCredentials::new())],
        MsgFlags::empty(),
        None,
    )
    .map_err(|e| format!("asking the agent: {e}"))?;
    (&stream).write_all(&message[first..]).map_err(|e| format!("asking the agent: {e}"))?;

    let mut signals = stream.try_clone().map_err(|e| e.to_string())?;
    std::thread::spawn(move || {
        while let Ok(signal) = forwarded.wait() {
            if writeln!(signals, "{}", json!({ "signal": signal as i32 })).is_err() {
                return;
            }
        }
    });
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply).map_err(|e| format!("waiting for the agent: {e}"))?;
    let reply: Value = serde_json::from_str(&reply).map_err(|_| "the agent went away".to_string())?;
    if let Some(code) = reply["exit"].as_i64() {
        return Ok(code as i32);
    }
    if let Some(message) = reply["refused"].as_str() {
        eprint!("{message}");
        return Ok(1);
    }
    Err(reply["error"].as_str().unwrap_or("the agent gave no answer").to_string())
}

// ------------------------------------------------------------- the server

/// Puts the shim in place and serves [`SOCKET`] on a thread of its own.
/// Problems are reported and leave the sandbox without the shim, never
/// without its agent.
pub fn serve() {
    install_shim();
    let listener = match listen() {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("space-agent: no sudo in this sandbox ({SOCKET}: {err})");
            return;
        }
    };
    let spawned = std::thread::Builder::new().name("sudo".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = std::thread::Builder::new().name("sudo-request".into()).spawn(move || answer(stream));
        }
    });
    if let Err(err) = spawned {
        eprintln!("space-agent: no sudo in this sandbox: {err}");
    }
}

/// Links [`SHIM`] to the agent, unless the root has a `sudo` there already
/// or no `/usr/local/bin` (an image of another make) or no agent at
/// [`AGENT_IN_ROOT`].
fn install_shim() {
    let shim = Path::new(SHIM);
    if fs::symlink_metadata(shim).is_ok() || !Path::new(AGENT_IN_ROOT).is_file() {
        return;
    }
    if shim.parent().is_some_and(Path::is_dir) {
        if let Err(err) = std::os::unix::fs::symlink(AGENT_IN_ROOT, shim) {
            eprintln!("space-agent: installing {SHIM}: {err}");
        }
    }
}

fn listen() -> io::Result<UnixListener> {
    let path = Path::new(SOCKET);
    if let Some(dir) = path.parent().filter(|d| !d.is_dir()) {
        fs::create_dir_all(dir)?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    }
    // Whatever stands there (a stale socket of an earlier boot, or
    // something a command put there) goes: the agent's socket is the one.
    match fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    let listener = UnixListener::bind(path)?;
    // Anyone may ask; the peer's credentials decide.
    fs::set_permissions(path, fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// The request as read, with the caller's standard streams.
struct Request {
    body: Value,
    fds: Vec<OwnedFd>,
    /// The caller, as the kernel vouches for it.
    peer: UnixCredentials,
}

fn read_request(stream: &UnixStream) -> Result<Request, String> {
    // gVisor's SO_PEERCRED answers with the asker's own credentials (the
    // agent's: root), never the peer's; credentials passed with the
    // message, which the kernel checks against the sender, are the peer's
    // under gVisor and Linux alike.
    setsockopt(stream, sockopt::PassCred, &true).map_err(|e| format!("SO_PASSCRED: {e}"))?;
    let mut length = [0u8; 4];
    let mut space = nix::cmsg_space!([RawFd; 3], libc::ucred);
    let mut iov = [IoSliceMut::new(&mut length)];
    let received = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| format!("reading the request: {e}"))?;
    let mut fds = Vec::new();
    let mut peer = None;
    for message in received.cmsgs().map_err(|e| e.to_string())? {
        match message {
            ControlMessageOwned::ScmRights(passed) => fds.extend(passed.into_iter().map(|fd| {
                // SAFETY: the kernel just installed these descriptors for
                // us; nothing else owns them.
                unsafe { OwnedFd::from_raw_fd(fd) }
            })),
            ControlMessageOwned::ScmCredentials(credentials) => peer = Some(credentials),
            _ => {}
        }
    }
    if received.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err("the request passed more than its standard streams".into());
    }
    let peer = peer.ok_or("the request carried no credentials")?;
    let got = received.bytes;
    if got < 4 {
        (&*stream).read_exact(&mut length[got..]).map_err(|e| format!("reading the request: {e}"))?;
    }
    let size = u32::from_be_bytes(length) as usize;
    if size > MAX_REQUEST {
        return Err("the request is too large".into());
    }
    let mut body = vec![0u8; size];
    (&*stream).read_exact(&mut body).map_err(|e| format!("reading the request: {e}"))?;
    if fds.len() != 3 {
        return Err("the request passed no standard streams".into());
    }
    let body = serde_json::from_slice(&body).map_err(|e| format!("a malformed request: {e}"))?;
    Ok(Request { body, fds, peer })
}

fn reply(mut stream: &UnixStream, answer: Value) {
    let _ = writeln!(stream, "{answer}");
}

fn answer(stream: UnixStream) {
    use std::sync::atomic::Ordering;
    if PENDING.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING {
        PENDING.fetch_sub(1, Ordering::SeqCst);
        return reply(&stream, json!({ "error": "too many requests at once" }));
    }
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let read = read_request(&stream);
    PENDING.fetch_sub(1, Ordering::SeqCst);
    let request = match read {
        Ok(request) => request,
        Err(message) => return reply(&stream, json!({ "error": message })),
    };
    let peer = request.peer;
    let _ = stream.set_read_timeout(None);
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    let groups = fs::read_to_string("/etc/group").unwrap_or_default();
    if peer.uid() != 0 {
        let caller = lookup(&passwd, &peer.uid().to_string());
        let name = caller.as_ref().map_or_else(|| peer.uid().to_string(), |a| a.name.clone());
        let primary = caller.as_ref().map_or(peer.gid(), |a| a.gid);
        if !allowed(&name, primary, &groups, &sudoers_rules()) {
            return reply(
                &stream,
                json!({ "refused": format!("{name} is not in the sudoers file.\nThis incident has been reported to the administrator.\n") }),
            );
        }
    }
    if request.body["validate"].as_bool() == Some(true) {
        return reply(&stream, json!({ "exit": 0 }));
    }
    let caller = lookup(&passwd, &peer.uid().to_string()).unwrap_or_else(|| Account::numeric(peer.uid()));
    let plan = match plan(&request.body, &caller, peer.gid(), &passwd, &groups) {
        Ok(plan) => plan,
        Err(message) => return reply(&stream, json!({ "refused": format!("sudo: {message}\n") })),
    };
    let [stdin, stdout, stderr]: [OwnedFd; 3] = match request.fds.try_into() {
        Ok(fds) => fds,
        Err(_) => return,
    };
    let mut command = Command::new(&plan.program);
    command
        .arg0(&plan.argv[0])
        .args(&plan.argv[1..])
        .env_clear()
        .envs(&plan.env)
        .current_dir(&plan.cwd)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr));
    let (uid, gid, groups) = (plan.account.uid, plan.account.gid, plan.groups.clone());
    // SAFETY: between fork and exec this calls only setsid, setgroups,
    // setgid and setuid, and allocates nothing (`groups` is ready).
    unsafe {
        command.pre_exec(move || {
            if libc::setsid() < 0
                || libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    crate::memory::process_starting();
    let spawned = crate::cgroup::spawn_in_group_of(peer.pid(), || Reaper::global().spawn(&mut command));
    drop(command); // our copies of the caller's streams
    let child = match spawned {
        Ok(child) => child,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return reply(&stream, json!({ "refused": format!("sudo: {}: command not found\n", plan.argv[0]) }))
        }
        Err(err) => {
            return reply(
                &stream,
                json!({ "refused": format!("sudo: unable to execute {}: {err}\n", plan.program.display()) }),
            )
        }
    };
    let pid = child.id() as i32;
    if let Ok(signals) = stream.try_clone() {
        std::thread::spawn(move || forward_signals(signals, pid));
    }
    let code = match child.wait() {
        ExitStatus::Exited(code) => code,
        ExitStatus::Signaled(signal) => 128 + signal,
    };
    reply(&stream, json!({ "exit": code }));
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Passes the caller's signals to the command's session (its process
/// group: the command leads it). Ends when the caller hangs up.
fn forward_signals(stream: UnixStream, pid: i32) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { return };
        let Some(number) = serde_json::from_str::<Value>(&line).ok().and_then(|v| v["signal"].as_i64()) else {
            continue;
        };
        let Ok(signal) = Signal::try_from(number as i32) else { continue };
        let group = nix::unistd::Pid::from_raw(-pid);
        if nix::sys::signal::kill(group, signal).is_err() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
        }
    }
}

/// An account from `/etc/passwd`.
#[derive(Debug, Clone, PartialEq)]
struct Account {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
    shell: String,
}

impl Account {
    fn numeric(uid: u32) -> Account {
        Account { name: uid.to_string(), uid, gid: uid, home: "/".into(), shell: "/bin/sh".into() }
    }
}

/// The account named (or numbered, `#1000` as sudo writes it, or `1000`).
fn lookup(passwd: &str, who: &str) -> Option<Account> {
    let number: Option<u32> = who.strip_prefix('#').unwrap_or(who).parse().ok();
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 7 {
            return None;
        }
        let (uid, gid) = (fields[2].parse().ok()?, fields[3].parse().ok()?);
        (fields[0] == who || number == Some(uid)).then(|| Account {
            name: fields[0].into(),
            uid,
            gid,
            home: fields[5].into(),
            shell: if fields[6].is_empty() { "/bin/sh".into() } else { fields[6].into() },
        })
    })
}

/// The groups `name` is a member of by `/etc/group` (its primary group
/// aside), as gids.
fn member_of(groups: &str, name: &str) -> Vec<(String, u32)> {
    groups
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            let members = fields.get(3)?;
            members
                .split(',')
                .any(|m| m.trim() == name)
                .then(|| Some((fields[0].to_string(), fields[2].parse().ok()?)))?
        })
        .collect()
}

/// Who sudoers lets run anything without a password: names and `%group`s
/// of lines `WHO ALL=(ALL…) NOPASSWD: ALL` in root-owned sudoers files that
/// no one else may write.
fn sudoers_rules() -> Vec<String> {
    let mut files = vec![PathBuf::from("/etc/sudoers")];
    if let Ok(dir) = fs::read_dir("/etc/sudoers.d") {
        let mut names: Vec<PathBuf> = dir.flatten().map(|e| e.path()).collect();
        names.sort();
        // sudo skips names with a dot or ending in `~`.
        files.extend(
            names.into_iter().filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !n.contains('.') && !n.ends_with('~'))
            }),
        );
    }
    files
        .into_iter()
        .filter(|file| fs::symlink_metadata(file).is_ok_and(|m| m.is_file() && m.uid() == 0 && m.mode() & 0o022 == 0))
        .filter_map(|file| fs::read_to_string(file).ok())
        .flat_map(|text| text.lines().filter_map(passwordless_rule).collect::<Vec<_>>())
        .collect()
}

/// The user or `%group` of a sudoers line granting everything without a
/// password.
fn passwordless_rule(line: &str) -> Option<String> {
    let line = line.trim();
    if line.starts_with('#') || line.starts_with("Defaults") {
        return None;
    }
    let (who, spec) = line.split_once(char::is_whitespace)?;
    let spec: String = spec.chars().filter(|c| !c.is_whitespace()).collect();
    let grants_all =
        ["ALL=(ALL)NOPASSWD:ALL", "ALL=(ALL:ALL)NOPASSWD:ALL", "ALL=NOPASSWD:ALL"].contains(&spec.as_str());
    grants_all.then(|| who.to_string())
}

/// Whether `name` (primary group `primary`) may run commands as anyone.
fn allowed(name: &str, primary: u32, groups: &str, rules: &[String]) -> bool {
    let mut in_groups = member_of(groups, name);
    let primary_name = groups.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.len() >= 3 && fields[2].parse() == Ok(primary)).then(|| fields[0].to_string())
    });
    in_groups.extend(primary_name.map(|n| (n, primary)));
    let in_group = |group: &str| in_groups.iter().any(|(g, _)| g == group);
    in_group("sudo")
        || rules.iter().any(|who| match who.strip_prefix('%') {
            Some(group) => in_group(group),
            None => who == name,
        })
}

/// What runs: program, argv, environment, directory, and as whom.
#[derive(Debug)]
struct Plan {
    program: PathBuf,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    cwd: String,
    account: Account,
    groups: Vec<libc::gid_t>,
}

/// sudo's quoting of a command for `shell -c`: every character but
/// letters, digits, `_`, `-` and `$` escaped with a backslash.
fn shell_quoted(command: &[String]) -> String {
    command
        .iter()
        .map(|arg| {
            arg.chars().fold(String::new(), |mut out, c| {
                if !(c.is_ascii_alphanumeric() || "_-$".contains(c)) {
                    out.push('\\');
                }
                out.push(c);
                out
            })
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn plan(body: &Value, caller: &Account, caller_gid: u32, passwd: &str, groups: &str) -> Result<Plan, String> {
    let strings = |key: &str| -> Vec<String> {
        body[key]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
            .unwrap_or_default()
    };
    let flag = |key: &str| body[key].as_bool() == Some(true);
    let target = match body["user"].as_str() {
        None => lookup(passwd, "root").unwrap_or_else(|| Account {
            name: "root".into(),
            home: "/root".into(),
            shell: "/bin/sh".into(),
            ..Account::numeric(0)
        }),
        Some(user) => match lookup(passwd, user) {
            Some(account) => account,
            None => match user.strip_prefix('#').and_then(|n| n.parse().ok()) {
                Some(uid) => Account::numeric(uid),
                None => return Err(format!("unknown user {user}")),
            },
        },
    };
    let caller_env: Vec<(String, String)> = body["env"]
        .as_array()
        .map(|pairs| {
            pairs
                .iter()
                .filter_map(|p| Some((p.get(0)?.as_str()?.to_string(), p.get(1)?.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    let command = strings("command");
    let (login, shell) = (flag("login"), flag("shell"));

    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let keep = strings("keep");
    for (key, value) in &caller_env {
        let kept = flag("preserve_env")
            || ENV_KEEP.contains(&key.as_str())
            || key.starts_with("LC_")
            || keep.iter().any(|k| k == key);
        // A login shell starts from nothing but the terminal.
        if kept && (!login || key == "TERM") {
            env.insert(key.clone(), value.clone());
        }
    }
    if !flag("preserve_env") || login {
        env.insert("HOME".into(), target.home.clone());
        env.insert("SHELL".into(), target.shell.clone());
        env.insert("USER".into(), target.name.clone());
        env.insert("LOGNAME".into(), target.name.clone());
        env.insert("MAIL".into(), format!("/var/mail/{}", target.name));
    }
    env.insert("PATH".into(), SECURE_PATH.into());
    // The sandbox's network goes through the agent's proxy: every command
    // needs it, sudo's included.
    env.extend(crate::egress::proxy_env().iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env.extend(crate::egress::trust_env().into_iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env.insert("SUDO_USER".into(), caller.name.clone());
    env.insert("SUDO_UID".into(), caller.uid.to_string());
    env.insert("SUDO_GID".into(), caller_gid.to_string());

    let (argv, program) = if login || shell {
        let shell_path = if login {
            target.shell.clone()
        } else {
            caller_env.iter().find(|(k, _)| k == "SHELL").map_or(target.shell.clone(), |(_, v)| v.clone())
        };
        let name = Path::new(&shell_path).file_name().map_or("sh".into(), |n| n.to_string_lossy().into_owned());
        let mut argv = vec![if login { format!("-{name}") } else { shell_path.clone() }];
        if !command.is_empty() {
            argv.extend(["-c".to_string(), shell_quoted(&command)]);
        }
        (argv, PathBuf::from(shell_path))
    } else {
        let program = resolve(&command[0])?;
        (command.clone(), program)
    };
    env.insert(
        "SUDO_COMMAND".into(),
        if login || shell {
            argv.join(" ")
        } else {
            std::iter::once(program.display().to_string())
                .chain(command.iter().skip(1).cloned())
                .collect::<Vec<_>>()
                .join(" ")
        },
    );
    let cwd = match body["chdir"].as_str() {
        Some(dir) => dir.to_string(),
        None if login => target.home.clone(),
        None => body["cwd"].as_str().unwrap_or("/").to_string(),
    };
    if !Path::new(&cwd).is_dir() {
        return Err(format!("unable to change directory to {cwd}: No such file or directory"));
    }
    let mut gids: Vec<libc::gid_t> = member_of(groups, &target.name).into_iter().map(|(_, gid)| gid).collect();
    if !gids.contains(&target.gid) {
        gids.insert(0, target.gid);
    }
    Ok(Plan { program, argv, env, cwd, groups: gids, account: target })
}

/// Finds a command on [`SECURE_PATH`] as sudo does.
fn resolve(program: &str) -> Result<PathBuf, String> {
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    SECURE_PATH
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|path| path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
        .ok_or_else(|| format!("{program}: command not found"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    fn options(text: &str) -> Options {
        match parse(&args(text)) {
            Ok(Parsed::Run(options)) => options,
            Ok(Parsed::Exit(code)) => panic!("{text}: exits {code}"),
            Err(err) => panic!("{text}: {err}"),
        }
    }

    #[test]
    fn options_code_uses_are_understood() {
        let parsed = options("-u user -E -- id -un");
        assert_eq!((parsed.user.as_deref(), parsed.preserve_env), (Some("user"), true));
        assert_eq!(parsed.command, args("id -un"));
        assert_eq!(options("-nEuuser id").user.as_deref(), Some("user"));
        assert_eq!(options("--user=www id").user.as_deref(), Some("www"));
        assert_eq!(options("--preserve-env=A,B env").keep, args("A B"));
        assert!(options("-i").login);
        assert_eq!(options("ls -l").command, args("ls -l"), "the command's options are its own");
        assert!(options("-v").only_validate);
        assert!(matches!(parse(&args("-l")), Err(m) if m.contains("-l is not supported")));
        assert!(matches!(parse(&args("--askpass x")), Err(m) if m.contains("not supported")));
        assert!(matches!(parse(&args("-u")), Err(m) if m.contains("requires an argument")));
        assert!(parse(&args("-E")).is_err(), "nothing to run");
    }

    const GROUPS: &str = "root:x:0:\nsudo:x:27:alice,bob\nwheel:x:10:carol\nuser:x:1000:\nstaff:x:50:\n";

    #[test]
    fn group_sudo_and_passwordless_sudoers_rules_allow_and_nothing_else() {
        let rules = vec!["user".to_string(), "%wheel".to_string()];
        assert!(allowed("alice", 100, GROUPS, &[]));
        assert!(allowed("user", 1000, GROUPS, &rules), "named in sudoers");
        assert!(allowed("carol", 100, GROUPS, &rules), "by %wheel");
        assert!(!allowed("mallory", 100, GROUPS, &rules));
        assert!(!allowed("user", 1000, GROUPS, &[]), "not in group sudo, not in sudoers");
        assert!(allowed("dave", 27, GROUPS, &[]), "sudo as the primary group");
        assert!(!allowed("alic", 100, GROUPS, &[]), "whole names only");
    }

    #[test]
    fn only_passwordless_rules_for_everything_count() {
        assert_eq!(passwordless_rule("user ALL=(ALL:ALL) NOPASSWD: ALL").as_deref(), Some("user"));
        assert_eq!(passwordless_rule("%admins ALL=(ALL) NOPASSWD:ALL").as_deref(), Some("%admins"));
        assert_eq!(passwordless_rule("%sudo ALL=(ALL:ALL) ALL"), None, "a password is asked");
        assert_eq!(passwordless_rule("bob ALL=(ALL) NOPASSWD: /usr/bin/apt"), None);
        assert_eq!(passwordless_rule("# user ALL=(ALL) NOPASSWD: ALL"), None);
        assert_eq!(passwordless_rule("Defaults env_reset"), None);
    }

    // `user`'s home is `/`: a directory the test host has.
    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/:/bin/bash\n";

    fn planned(body: Value) -> Plan {
        let caller = lookup(PASSWD, "user").unwrap();
        plan(&body, &caller, 1000, PASSWD, GROUPS).unwrap()
    }

    #[test]
    fn the_environment_is_reset_as_sudo_resets_it() {
        let env = json!([["TERM", "xterm"], ["FOO", "1"], ["HOME", "/home/user"], ["LC_ALL", "C"], ["PATH", "/x"]]);
        let plan = planned(json!({ "command": ["sh", "-c", "true"], "env": env, "cwd": "/tmp" }));
        assert_eq!(plan.env.get("FOO"), None);
        assert_eq!(plan.env["TERM"], "xterm");
        assert_eq!(plan.env["LC_ALL"], "C");
        assert_eq!(plan.env["HOME"], "/root");
        assert_eq!(plan.env["PATH"], SECURE_PATH);
        assert_eq!((plan.env["SUDO_USER"].as_str(), plan.env["SUDO_UID"].as_str()), ("user", "1000"));
        assert_eq!((plan.account.uid, plan.cwd.as_str()), (0, "/tmp"));
        assert!(
            plan.program.is_absolute() && plan.program.ends_with("sh"),
            "found on the secure path: {:?}",
            plan.program
        );
        assert_eq!(plan.argv[0], "sh");

        let kept = planned(json!({ "command": ["true"], "env": env, "preserve_env": true, "user": "user" }));
        assert_eq!((kept.env["FOO"].as_str(), kept.env["HOME"].as_str()), ("1", "/home/user"));
        assert_eq!((kept.account.uid, kept.env["PATH"].as_str()), (1000, SECURE_PATH));
    }

    #[test]
    fn a_login_shell_runs_the_command_quoted_in_the_targets_home() {
        let plan = planned(json!({ "command": ["echo", "a b;c"], "login": true, "user": "user", "cwd": "/tmp" }));
        assert_eq!(plan.argv, vec!["-bash".to_string(), "-c".into(), "echo a\\ b\\;c".into()]);
        assert_eq!((plan.program.to_str(), plan.cwd.as_str()), (Some("/bin/bash"), "/"));
        assert_eq!(plan.env["HOME"], "/");
    }

    #[test]
    fn unknown_users_and_commands_are_named() {
        let caller = lookup(PASSWD, "user").unwrap();
        let err = plan(&json!({ "command": ["true"], "user": "nobody-here" }), &caller, 1000, PASSWD, GROUPS);
        assert_eq!(err.unwrap_err(), "unknown user nobody-here");
        let err = plan(&json!({ "command": ["no-such-command-x"] }), &caller, 1000, PASSWD, GROUPS);
        assert_eq!(err.unwrap_err(), "no-such-command-x: command not found");
        let err = plan(&json!({ "command": ["true"], "cwd": "/no/such/dir" }), &caller, 1000, PASSWD, GROUPS);
        assert_eq!(err.unwrap_err(), "unable to change directory to /no/such/dir: No such file or directory");
    }
}
