//! The agent as `/init` of a Firecracker guest's initramfs: it loads the
//! virtio and vsock modules listed in `/modules.order`, mounts the
//! template's root drive, moves into it and stays PID 1 there; the host is
//! then reached over vsock (CID 2) instead of a Unix socket.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};

/// The list the initramfs carries; its presence means "boot from here".
const MODULES_ORDER: &str = "/modules.order";
/// The root drive Firecracker attaches first.
const ROOT_DEVICE: &str = "/dev/vda";
const NEW_ROOT: &str = "/newroot";
/// The host's vsock address as the guest sees it, and the agent's port.
pub const HOST_CID: u32 = 2;
pub const AGENT_PORT: u32 = 1024;

/// Whether this process is `/init` of an initramfs made for it.
pub fn in_initramfs() -> bool {
    std::process::id() == 1 && Path::new(MODULES_ORDER).is_file()
}

/// Loads the modules, mounts the root drive and switches into it.
pub fn boot() -> Result<(), String> {
    let none: Option<&str> = None;
    let fs_mount = |source: &str, target: &str, fstype: &str| {
        fs::create_dir_all(target).map_err(|e| format!("creating {target}: {e}"))?;
        mount(Some(source), target, Some(fstype), MsFlags::empty(), none).map_err(|e| format!("mounting {target}: {e}"))
    };
    fs_mount("proc", "/proc", "proc")?;
    fs_mount("sysfs", "/sys", "sysfs")?;
    fs_mount("devtmpfs", "/dev", "devtmpfs")?;
    // The guest's only interface: the egress proxy and programs' own
    // servers listen on it.
    bring_up_loopback()?;
    let order = fs::read_to_string(MODULES_ORDER).map_err(|e| format!("reading {MODULES_ORDER}: {e}"))?;
    for module in order.lines().filter(|l| !l.trim().is_empty()) {
        let file = fs::File::open(module).map_err(|e| format!("opening {module}: {e}"))?;
        match nix::kmod::finit_module(&file, c"", nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(err) => return Err(format!("loading {module}: {err}")),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !Path::new(ROOT_DEVICE).exists() {
        if Instant::now() > deadline {
            return Err(format!("{ROOT_DEVICE} did not appear"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    fs::create_dir_all(NEW_ROOT).map_err(|e| e.to_string())?;
    mount(Some(ROOT_DEVICE), NEW_ROOT, Some("ext4"), MsFlags::empty(), none)
        .map_err(|e| format!("mounting the root drive: {e}"))?;
    for dir in ["dev", "proc", "sys"] {
        let target = format!("{NEW_ROOT}/{dir}");
        fs::create_dir_all(&target).map_err(|e| format!("creating {target}: {e}"))?;
        mount(Some(format!("/{dir}").as_str()), target.as_str(), none, MsFlags::MS_MOVE, none)
            .map_err(|e| format!("moving /{dir}: {e}"))?;
    }
    // switch_root: the new root takes /'s place; the initramfs stays behind
    // (it is freed with nothing referring to it).
    std::env::set_current_dir(NEW_ROOT).map_err(|e| e.to_string())?;
    mount(Some("."), "/", none, MsFlags::MS_MOVE, none).map_err(|e| format!("moving the root: {e}"))?;
    nix::unistd::chroot(".").map_err(|e| format!("chroot: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| e.to_string())?;
    BOOTED_VM.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Mounts the microVM's volume drives (ext4, `nosuid,nodev`, `ro` for a
/// read-only mount) where the host's welcome says, each mount point made
/// first. Called once, before any command runs; a drive that is not there
/// or does not mount is an error (the sandbox must not run without it:
/// its writes would land on the root drive).
pub fn mount_volumes(volumes: &[space_proto::GuestVolume]) -> Result<(), String> {
    for volume in volumes {
        let device = volume_device(&volume.device)?;
        if !volume.path.starts_with('/') || volume.path == "/" {
            return Err(format!("volume path {:?} is not a directory below /", volume.path));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !Path::new(&device).exists() {
            if Instant::now() > deadline {
                return Err(format!("{device} did not appear"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        fs::create_dir_all(&volume.path).map_err(|e| format!("creating {}: {e}", volume.path))?;
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if volume.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        mount(Some(device.as_str()), volume.path.as_str(), Some("ext4"), flags, None::<&str>)
            .map_err(|e| format!("mounting {device} at {}: {e}", volume.path))?;
        MOUNTED.lock().unwrap_or_else(|e| e.into_inner()).push(volume.path.clone());
    }
    Ok(())
}

/// The volumes [`mount_volumes`] mounted, for [`stop`].
static MOUNTED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Where the SIGINT handler says Ctrl-Alt-Del came (a pipe's write end).
static STOP_PIPE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn on_sigint(_: nix::libc::c_int) {
    let fd = STOP_PIPE.load(std::sync::atomic::Ordering::Relaxed);
    // SAFETY: write(2) is async-signal-safe; the buffer is a static byte.
    unsafe { nix::libc::write(fd, b"!".as_ptr().cast(), 1) };
}

/// How long the guest's processes have to be gone before the volumes are
/// unmounted regardless (lazily, after a sync).
const STOP_PATIENCE: Duration = Duration::from_secs(2);

/// Makes Ctrl-Alt-Del (what the host's `SendCtrlAltDel` presses) stop the
/// microVM cleanly: the kernel sends the init SIGINT instead of resetting,
/// and the agent then [`stop`]s. A handler, not a blocked signal: the
/// programs it starts inherit a mask but not a handler.
pub fn stop_on_ctrl_alt_del() -> Result<(), String> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("a pipe: {e}"))?;
    STOP_PIPE.store(std::os::fd::IntoRawFd::into_raw_fd(write), std::sync::atomic::Ordering::Relaxed);
    let action = SigAction::new(SigHandler::Handler(on_sigint), SaFlags::SA_RESTART, SigSet::empty());
    // SAFETY: the handler only writes a byte to a pipe.
    unsafe { sigaction(Signal::SIGINT, &action) }.map_err(|e| format!("handling SIGINT: {e}"))?;
    // SAFETY: reboot(2) with LINUX_REBOOT_CMD_CAD_OFF takes no pointer.
    if unsafe { nix::libc::reboot(nix::libc::LINUX_REBOOT_CMD_CAD_OFF) } != 0 {
        return Err(format!("turning Ctrl-Alt-Del into SIGINT: {}", std::io::Error::last_os_error()));
    }
    std::thread::Builder::new()
        .name("stop".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            let mut read = fs::File::from(read);
            if std::io::Read::read(&mut read, &mut byte).is_ok_and(|n| n == 1) {
                stop();
            }
        })
        .map(drop)
        .map_err(|e| format!("the stop thread: {e}"))
}

/// Stops the microVM so that nothing written to a volume is lost: every
/// process is killed, the volumes are unmounted (their page cache written
/// back, their journal closed), everything else synced, and the kernel
/// restarts — which ends the VMM.
fn stop() {
    eprintln!("space-agent: stopping: unmounting the volumes");
    // SAFETY: kill(-1) signals every process but this one (PID 1).
    unsafe { nix::libc::kill(-1, nix::libc::SIGKILL) };
    let volumes: Vec<String> = MOUNTED.lock().unwrap_or_else(|e| e.into_inner()).iter().rev().cloned().collect();
    let deadline = Instant::now() + STOP_PATIENCE;
    for path in &volumes {
        loop {
            match nix::mount::umount2(path.as_str(), nix::mount::MntFlags::empty()) {
                Ok(()) => break,
                // Killed processes still let go of their files.
                Err(nix::errno::Errno::EBUSY) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(err) => {
                    eprintln!("space-agent: unmounting {path}: {err}; syncing it instead");
                    break;
                }
            }
        }
    }
    nix::unistd::sync();
    // SAFETY: reboot(2) with LINUX_REBOOT_CMD_RESTART takes no pointer.
    unsafe { nix::libc::reboot(nix::libc::LINUX_REBOOT_CMD_RESTART) };
}

/// `/dev/<name>` for a volume drive's name: `vdb` to `vdz` (`vda` is the
/// root drive), nothing else.
fn volume_device(name: &str) -> Result<String, String> {
    match name.as_bytes() {
        [b'v', b'd', letter] if (b'b'..=b'z').contains(letter) => Ok(format!("/dev/{name}")),
        _ => Err(format!("{name:?} is not a volume drive")),
    }
}

/// A stream to the host over vsock, usable wherever a Unix stream is (both
/// are plain stream sockets to read, write and shut down).
pub fn dial_vsock() -> std::io::Result<std::os::unix::net::UnixStream> {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, VsockAddr};
    let fd = socket(AddressFamily::Vsock, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &VsockAddr::new(HOST_CID, AGENT_PORT))?;
    Ok(std::os::unix::net::UnixStream::from(fd))
}

/// How far the guest's clock may be off the host's before the agent sets it.
const CLOCK_SLACK_MS: u64 = 100;

/// Sets the guest's wall clock to the host's (`host_ms` since the epoch)
/// when it is off: a microVM restored from a snapshot wakes with the time
/// it was saved at.
pub fn set_clock(host_ms: u64) {
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    if now.abs_diff(host_ms) < CLOCK_SLACK_MS {
        return;
    }
    let time = nix::sys::time::TimeSpec::new((host_ms / 1000) as i64, ((host_ms % 1000) * 1_000_000) as i64);
    if let Err(err) = nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, time) {
        eprintln!("space-agent: setting the clock: {err}");
    }
}

// RNDADDENTROPY takes `struct rand_pool_info { int entropy_count; int
// buf_size; __u32 buf[]; }`; its size in the request code is the two ints.
nix::ioctl_write_ptr_bad!(rnd_add_entropy, nix::request_code_write!(b'R', 0x03, 8), u8);
nix::ioctl_none!(rnd_reseed_crng, b'R', 0x07);

/// Mixes `bytes` into the kernel's random state. Where the kernel allows it
/// (a microVM's init, which holds CAP_SYS_ADMIN) they are also credited and
/// the CRNG is reseeded at once, so a clone of a snapshot never continues
/// the random stream its template was saved with. Under gVisor the ioctls
/// are refused and the write alone is enough: its random device draws from
/// the host on every read.
pub fn add_entropy(bytes: &[u8]) {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let mut device = match fs::OpenOptions::new().write(true).open("/dev/urandom") {
        Ok(device) => device,
        Err(err) => return eprintln!("space-agent: opening /dev/urandom: {err}"),
    };
    // Writing mixes the bytes in without crediting them.
    if let Err(err) = device.write_all(bytes) {
        eprintln!("space-agent: mixing in entropy: {err}");
    }
    if bytes.is_empty() || !booted_vm() {
        return;
    }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&(bytes.len() as i32 * 8).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    // SAFETY: `info` is a complete rand_pool_info (header and `buf_size`
    // bytes) that outlives the call; RNDRESEEDCRNG takes no argument.
    let credited = unsafe { rnd_add_entropy(device.as_raw_fd(), info.as_ptr()) }
        .and_then(|_| unsafe { rnd_reseed_crng(device.as_raw_fd()) });
    if let Err(err) = credited {
        eprintln!("space-agent: reseeding the kernel's random generator: {err}");
    }
}

/// Whether this agent booted a microVM (it is PID 1 and switched from the
/// initramfs into the root drive).
/// `ip link set lo up`: a booted kernel leaves it down.
fn bring_up_loopback() -> Result<(), String> {
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    let socket = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| format!("a socket to configure lo: {e}"))?;
    // SAFETY: `ifreq` is plain data; all zeroes is a valid value.
    let mut request: nix::libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as nix::libc::c_char;
    }
    request.ifr_ifru.ifru_flags = (nix::libc::IFF_UP | nix::libc::IFF_RUNNING) as nix::libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads an `ifreq` naming the interface and its flags.
    let rc = unsafe { nix::libc::ioctl(socket.as_raw_fd(), nix::libc::SIOCSIFFLAGS, &request) };
    if rc != 0 {
        return Err(format!("bringing lo up: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

pub fn booted_vm() -> bool {
    BOOTED_VM.load(std::sync::atomic::Ordering::Relaxed)
}

static BOOTED_VM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What `/dev` may hold under gVisor: device nodes, links and the odd
/// small file need no more.
const DEV_SIZE: &str = "size=4m";

/// Puts a tmpfs of [`DEV_SIZE`] over gVisor's `/dev`, with the same nodes,
/// links and submounts (`/dev/pts`, `/dev/shm`). runsc mounts a `/dev` of
/// its own whatever the OCI spec says, without a size limit, so a command
/// could fill it with the sandbox's memory; now a write past the cap fails
/// with ENOSPC. Called once, before any command runs; on failure the
/// runtime's `/dev` is left as it was.
pub fn cap_dev() -> Result<(), String> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use nix::fcntl::OFlag;
    use nix::mount::{umount2, MntFlags};
    use nix::sys::stat::Mode;

    let submounts = dev_submounts(&fs::read_to_string("/proc/self/mountinfo").unwrap_or_default());
    let old = nix::fcntl::open("/dev", OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| format!("opening /dev: {e}"))?;
    // SAFETY: open returned a new descriptor that nothing else owns.
    let old = unsafe { OwnedFd::from_raw_fd(old) };
    // The runtime's /dev stays reachable through the descriptor once the
    // new one covers it.
    let from = format!("/proc/self/fd/{}", old.as_raw_fd());
    let none: Option<&str> = None;
    mount(Some("tmpfs"), "/dev", Some("tmpfs"), MsFlags::MS_NOSUID, Some(format!("{DEV_SIZE},mode=755").as_str()))
        .map_err(|e| format!("mounting a tmpfs on /dev: {e}"))?;
    let filled = copy_dev(Path::new(&from), Path::new("/dev"), &submounts).and_then(|()| {
        for name in &submounts {
            let (source, target) = (format!("{from}/{name}"), format!("/dev/{name}"));
            mount(Some(source.as_str()), target.as_str(), none, MsFlags::MS_BIND, none)
                .map_err(|e| format!("binding {target}: {e}"))?;
        }
        Ok(())
    });
    if filled.is_err() {
        let _ = umount2("/dev", MntFlags::MNT_DETACH);
    }
    filled
}

/// The mounts directly under `/dev` in a mountinfo listing, by name.
fn dev_submounts(mountinfo: &str) -> Vec<String> {
    let mut names: Vec<String> = mountinfo
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4)?.strip_prefix("/dev/"))
        .filter(|name| !name.is_empty() && !name.contains('/'))
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Recreates the tree at `from` under `to`: directories, links, device
/// nodes and small files, with their modes and owners. Of a submount only
/// its mount point is made.
fn copy_dev(from: &Path, to: &Path, submounts: &[String]) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

    use nix::sys::stat::{mknod, Mode, SFlag};

    let entries = fs::read_dir(from).map_err(|e| format!("reading {}: {e}", from.display()))?;
    for entry in entries.flatten() {
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        let meta = fs::symlink_metadata(&source).map_err(|e| format!("{}: {e}", source.display()))?;
        let kind = meta.file_type();
        let made = if kind.is_symlink() {
            fs::read_link(&source).and_then(|link| std::os::unix::fs::symlink(link, &target))
        } else if kind.is_dir() {
            fs::create_dir(&target)
        } else if kind.is_char_device() || kind.is_block_device() {
            let node = if kind.is_char_device() { SFlag::S_IFCHR } else { SFlag::S_IFBLK };
            mknod(&target, node, Mode::from_bits_truncate(meta.mode()), meta.rdev()).map_err(std::io::Error::from)
        } else if kind.is_file() {
            fs::copy(&source, &target).map(drop)
        } else {
            continue; // sockets and FIFOs belong to whoever made them
        };
        made.map_err(|e| format!("making {}: {e}", target.display()))?;
        if !kind.is_symlink() {
            let _ = fs::set_permissions(&target, fs::Permissions::from_mode(meta.mode() & 0o7777));
        }
        let _ = std::os::unix::fs::lchown(&target, Some(meta.uid()), Some(meta.gid()));
        let is_submount = submounts.iter().any(|name| entry.file_name() == name.as_str());
        if kind.is_dir() && !is_submount {
            copy_dev(&source, &target, &[])?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_drives_after_the_root_are_volumes() {
        assert_eq!(volume_device("vdb").unwrap(), "/dev/vdb");
        assert_eq!(volume_device("vdz").unwrap(), "/dev/vdz");
        for bad in ["vda", "vd", "sda", "vdb1", "../vdb", "vd{", ""] {
            assert!(volume_device(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_mounts_under_dev_are_found_by_name() {
        let mountinfo = "18 16 0:18 / /dev rw - tmpfs none rw\n\
                         23 18 0:23 / /dev/pts rw - devpts none rw\n\
                         24 18 0:24 / /dev/shm rw,noexec - tmpfs none rw,size=65536k\n\
                         30 24 0:30 / /dev/shm/deep rw - tmpfs none rw\n\
                         31 16 0:31 / /devices rw - tmpfs none rw\n";
        assert_eq!(dev_submounts(mountinfo), ["pts", "shm"]);
    }

    #[test]
    fn a_dev_tree_is_copied_without_its_submounts_content() {
        let scratch = std::env::temp_dir().join(format!("space-dev-copy-{}", std::process::id()));
        let _ = fs::remove_dir_all(&scratch);
        let (from, to) = (scratch.join("from"), scratch.join("to"));
        fs::create_dir_all(from.join("net")).unwrap();
        fs::create_dir_all(from.join("pts")).unwrap();
        fs::write(from.join("pts/ptmx-content"), "devpts's").unwrap();
        fs::write(from.join("net/note"), "small").unwrap();
        std::os::unix::fs::symlink("/proc/self/fd", from.join("fd")).unwrap();
        fs::create_dir_all(&to).unwrap();
        copy_dev(&from, &to, &["pts".to_string()]).unwrap();
        assert_eq!(fs::read_link(to.join("fd")).unwrap(), Path::new("/proc/self/fd"));
        assert_eq!(fs::read_to_string(to.join("net/note")).unwrap(), "small");
        assert!(to.join("pts").is_dir());
        assert!(!to.join("pts/ptmx-content").exists(), "a submount's content is its own");
        fs::remove_dir_all(&scratch).unwrap();
    }
}
