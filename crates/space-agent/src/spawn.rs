//! Starting a process with `posix_spawn`.
//!
//! Under gVisor a `fork` of the agent costs tens of milliseconds while a
//! `posix_spawn` (a vfork) costs a third of that, and `std::process` falls
//! back to `fork` in a static binary whenever a working directory is set (it
//! cannot find `posix_spawn_file_actions_addchdir_np` at run time). So root's
//! commands, the common case, are spawned here; other users go through
//! `std::process`, which can drop privileges.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::ptr;

use nix::fcntl::OFlag;
use nix::unistd::pipe2;

/// The host ends of a spawned process's standard streams.
pub struct Pipes {
    pub stdin: Option<File>,
    pub stdout: File,
    pub stderr: File,
}

fn cstring(text: &str) -> io::Result<CString> {
    CString::new(text).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in an argument"))
}

fn check(code: libc::c_int) -> io::Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(code))
    }
}

/// Owns posix_spawn's attribute and file-action objects.
struct SpawnSetup {
    attr: libc::posix_spawnattr_t,
    actions: libc::posix_spawn_file_actions_t,
}

impl SpawnSetup {
    fn new() -> io::Result<Box<SpawnSetup>> {
        let mut setup = Box::new(MaybeUninit::<SpawnSetup>::uninit());
        let raw = setup.as_mut_ptr();
        // SAFETY: both objects are initialised by their init functions
        // before use; on failure of the second the first is destroyed.
        unsafe {
            check(libc::posix_spawnattr_init(ptr::addr_of_mut!((*raw).attr)))?;
            if let Err(err) = check(libc::posix_spawn_file_actions_init(ptr::addr_of_mut!((*raw).actions))) {
                libc::posix_spawnattr_destroy(ptr::addr_of_mut!((*raw).attr));
                return Err(err);
            }
            // SAFETY: both fields are initialised now.
            Ok(Box::from_raw(Box::into_raw(setup).cast::<SpawnSetup>()))
        }
    }
}

impl Drop for SpawnSetup {
    fn drop(&mut self) {
        // SAFETY: both were initialised in `new` and are destroyed once.
        unsafe {
            libc::posix_spawn_file_actions_destroy(&mut self.actions);
            libc::posix_spawnattr_destroy(&mut self.attr);
        }
    }
}

/// Spawns `program` as root in its own process group, with default signal
/// dispositions, an empty signal mask, working directory `cwd`, exactly the
/// environment `env`, and fresh pipes for stdout and stderr (and stdin when
/// asked; /dev/null otherwise). Returns the pid and the host ends.
pub fn spawn(
    program: &Path,
    argv: &[String],
    env: &[(String, String)],
    cwd: &str,
    want_stdin: bool,
) -> io::Result<(u32, Pipes)> {
    let program = cstring(&program.to_string_lossy())?;
    let argv: Vec<CString> = argv.iter().map(|a| cstring(a)).collect::<io::Result<_>>()?;
    let envp: Vec<CString> = env.iter().map(|(k, v)| cstring(&format!("{k}={v}"))).collect::<io::Result<_>>()?;
    let cwd = cstring(cwd)?;
    let mut argv_ptrs: Vec<*mut libc::c_char> = argv.iter().map(|a| a.as_ptr() as *mut _).collect();
    argv_ptrs.push(ptr::null_mut());
    let mut envp_ptrs: Vec<*mut libc::c_char> = envp.iter().map(|e| e.as_ptr() as *mut _).collect();
    envp_ptrs.push(ptr::null_mut());

    let (stdin_child, stdin_host): (OwnedFd, Option<OwnedFd>) = if want_stdin {
        let (read, write) = pipe2(OFlag::O_CLOEXEC)?;
        (read, Some(write))
    } else {
        (File::open("/dev/null")?.into(), None)
    };
    let (stdout_host, stdout_child) = pipe2(OFlag::O_CLOEXEC)?;
    let (stderr_host, stderr_child) = pipe2(OFlag::O_CLOEXEC)?;

    let mut setup = SpawnSetup::new()?;
    let flags = libc::POSIX_SPAWN_SETPGROUP | libc::POSIX_SPAWN_SETSIGDEF | libc::POSIX_SPAWN_SETSIGMASK;
    let mut pid: libc::pid_t = 0;
    // SAFETY: `setup` holds initialised objects; the signal sets are
    // initialised by sigemptyset/sigfillset before use; every pointer passed
    // to posix_spawn (program, argv, envp, cwd) points into CStrings that
    // outlive the call, and both pointer arrays end with NULL. The child's
    // descriptors are duplicated onto 0-2; the originals are O_CLOEXEC.
    unsafe {
        let mut empty = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(empty.as_mut_ptr());
        let mut all = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigfillset(all.as_mut_ptr());
        check(libc::posix_spawnattr_setflags(&mut setup.attr, flags as libc::c_short))?;
        check(libc::posix_spawnattr_setpgroup(&mut setup.attr, 0))?;
        check(libc::posix_spawnattr_setsigmask(&mut setup.attr, empty.as_ptr()))?;
        check(libc::posix_spawnattr_setsigdefault(&mut setup.attr, all.as_ptr()))?;
        check(libc::posix_spawn_file_actions_adddup2(&mut setup.actions, stdin_child.as_raw_fd(), 0))?;
        check(libc::posix_spawn_file_actions_adddup2(&mut setup.actions, stdout_child.as_raw_fd(), 1))?;
        check(libc::posix_spawn_file_actions_adddup2(&mut setup.actions, stderr_child.as_raw_fd(), 2))?;
        check(libc::posix_spawn_file_actions_addchdir_np(&mut setup.actions, cwd.as_ptr()))?;
        check(libc::posix_spawn(
            &mut pid,
            program.as_ptr(),
            &setup.actions,
            &setup.attr,
            argv_ptrs.as_ptr(),
            envp_ptrs.as_ptr(),
        ))?;
    }
    // The child has its copies; ours must close so EOF reaches the pumps.
    drop((stdin_child, stdout_child, stderr_child));
    Ok((
        pid as u32,
        Pipes { stdin: stdin_host.map(File::from), stdout: stdout_host.into(), stderr: stderr_host.into() },
    ))
}
