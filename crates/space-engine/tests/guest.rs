//! The guest half of the Firecracker engine, run for real on hosts where
//! Firecracker cannot boot a guest (no vmx/svm): Debian's cloud kernel and
//! the initramfs `space setup` built (the agent as `/init`) boot under
//! QEMU's `microvm` machine — virtio-mmio devices, as in Firecracker — in
//! software emulation, with a vhost-user vsock device whose host side
//! follows Firecracker's hybrid scheme (the guest dials CID 2 port P, the
//! host listens on `<uds>_P`). The agent must load its modules, mount the
//! root drive, switch into it, dial home and serve the real host side
//! (`AgentConn`): commands, its hostname and the host's clock, fresh
//! entropy, and a quiesce and redial as another sandbox — what a clone of
//! a template snapshot goes through.
//!
//! It needs `qemu-system-x86_64` and `vhost-device-vsock`, which
//! `scripts/test.sh` installs (Debian's qemu-system-x86; the crate from
//! crates.io into `target/tools`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::sh;
use space_engine::{AgentConn, SandboxSpec};
use space_host::datadir::DataDir;
use space_host::template::BASE_TEMPLATE;
use space_process::{ReapedChild, Reaper};
use space_testkit::{shared_data_dir, TestDataDir};

/// Software emulation is slow; the guest still boots in seconds. The whole
/// boot is bounded by this, and a console that says nothing new for
/// [`STALL`] fails the test at once, with the console in the message.
const BOOT_PATIENCE: Duration = Duration::from_secs(120);
const STALL: Duration = Duration::from_secs(30);
const PATIENCE: Duration = Duration::from_secs(30);

/// `name` from `env`, else `PATH`, else `target/tools/bin`.
fn tool(name: &str, env: &str) -> PathBuf {
    let installed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/bin").join(name);
    std::env::var_os(env)
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH")
                .and_then(|paths| std::env::split_paths(&paths).map(|dir| dir.join(name)).find(|path| path.is_file()))
        })
        .or_else(|| installed.is_file().then_some(installed))
        .unwrap_or_else(|| panic!("{name} is missing: run scripts/test.sh, which installs it (or set {env})"))
}

/// The guest's processes on the host; killed when the test ends.
struct Processes(Vec<ReapedChild>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &self.0 {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait_timeout(Duration::from_secs(5));
        }
    }
}

/// A guest under QEMU: its processes (killed when it is dropped), the
/// socket its agent dials and its console's log.
struct Vm {
    processes: Processes,
    qemu_pid: u32,
    listener: tokio::net::UnixListener,
    console: PathBuf,
}

impl Vm {
    /// Boots the kernel and `initramfs` on the root drive `root` (`vda`)
    /// and the extra drives `drives` (`vdb` onwards, each read-only or
    /// not), in `dir`, with a vsock device as Firecracker's.
    async fn boot(dir: &Path, bzimage: &Path, initramfs: &Path, root: &Path, drives: &[(&Path, bool)]) -> Vm {
        let qemu = tool("qemu-system-x86_64", "SPACE_QEMU_BIN");
        let vhost = tool("vhost-device-vsock", "SPACE_VHOST_VSOCK_BIN");
        let listener = tokio::net::UnixListener::bind(dir.join("vm.vsock_1024")).unwrap();
        let mut processes = Processes(Vec::new());
        let control = dir.join("vhost.sock");
        let mut device = Command::new(&vhost);
        device.args(["--guest-cid", "3", "--socket"]).arg(&control).arg("--uds-path").arg(dir.join("vm.vsock"));
        device.stdin(Stdio::null()).stdout(std::fs::File::create(dir.join("vhost.log")).unwrap()).stderr(Stdio::null());
        processes.0.push(Reaper::global().spawn(&mut device).expect("starting vhost-device-vsock"));
        let started = Instant::now();
        while !control.exists() {
            assert!(started.elapsed() < PATIENCE, "vhost-device-vsock did not listen");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let console = dir.join("console.log");
        let mut vm = Command::new(&qemu);
        vm.args(["-M", "microvm,memory-backend=mem", "-cpu", "max", "-m", "512"])
            .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
            .args(["-nographic", "-no-reboot"])
            // A clock far off the host's: the agent must set it from the welcome.
            .args(["-rtc", "base=2001-01-01T00:00:00"])
            .arg("-kernel")
            .arg(bzimage)
            .arg("-initrd")
            .arg(initramfs)
            .arg("-append")
            .arg(format!("console=ttyS0 reboot=k panic=1 quiet tsc_early_khz={} tsc=reliable", tsc_khz()));
        // Firecracker attaches the root drive first, then the others in
        // order; the guest names them vda, vdb, ... as it finds them.
        let all = std::iter::once((root, false)).chain(drives.iter().copied());
        for (index, (drive, read_only)) in all.enumerate() {
            let read_only = if read_only { ",readonly=on" } else { "" };
            vm.arg("-drive")
                .arg(format!("id=drive{index},file={},format=raw,if=none{read_only}", drive.display()))
                .args(["-device", &format!("virtio-blk-device,drive=drive{index}")]);
        }
        vm.arg("-chardev")
            .arg(format!("socket,id=vsock,path={}", control.display()))
            .args(["-device", "vhost-user-vsock-device,chardev=vsock"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&console).unwrap())
            .stderr(Stdio::null());
        let qemu = Reaper::global().spawn(&mut vm).expect("starting qemu");
        let qemu_pid = qemu.id();
        processes.0.push(qemu);
        Vm { processes, qemu_pid, listener, console }
    }

    fn qemu(&self) -> &ReapedChild {
        self.processes.0.iter().find(|child| child.id() == self.qemu_pid).unwrap()
    }
}

fn spec(id: &str, env: &[(&str, &str)]) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        dir: PathBuf::from("/nonexistent"),
        template_rootfs: PathBuf::from("/nonexistent"),
        hostname: id.replace('_', "-"),
        vcpus: 1,
        memory_mib: 512,
        disk_mib: 64,
        env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        workdir: None,
        user: None,
        engine: None,
        trust_pem: None,
        volumes: Vec::new(),
    }
}

/// Waits for the agent to dial in; fails fast, with the console, when QEMU
/// exits or the guest stalls (says nothing new on its console for [`STALL`]).
async fn accept(
    listener: &tokio::net::UnixListener,
    what: &str,
    console: &Path,
    qemu: &ReapedChild,
) -> tokio::net::UnixStream {
    let started = Instant::now();
    let mut said = (0, Instant::now());
    let fail = |why: String| -> ! {
        panic!("{what}: {why}; console:\n{}", std::fs::read_to_string(console).unwrap_or_default())
    };
    loop {
        match tokio::time::timeout(Duration::from_millis(500), listener.accept()).await {
            Ok(Ok((socket, _))) => return socket,
            Ok(Err(err)) => fail(format!("accepting the agent: {err}")),
            Err(_) => {}
        }
        if let Some(status) = qemu.wait_timeout(Duration::ZERO) {
            fail(format!("QEMU exited ({status:?}) before the agent dialed in"));
        }
        let length = std::fs::metadata(console).map(|m| m.len()).unwrap_or(0);
        if length != said.0 {
            said = (length, Instant::now());
        } else if said.1.elapsed() > STALL {
            fail(format!("the guest stalled: nothing on its console for {STALL:?}"));
        }
        if started.elapsed() > BOOT_PATIENCE {
            fail(format!("the agent did not dial in within {BOOT_PATIENCE:?}"));
        }
    }
}

/// The host's TSC frequency in kHz, which QEMU's software emulation passes
/// through. Given to the guest kernel (`tsc_early_khz=`) so it need not
/// calibrate: `microvm` has no HPET or PM timer to calibrate against, and
/// where the CPU does not report its TSC frequency (AMD) the kernel would
/// mark the TSC unstable and stall.
fn tsc_khz() -> u64 {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("cpu MHz")?.split(':').nth(1)?.trim().parse::<f64>().ok())
        .map_or(2_000_000, |mhz| (mhz * 1000.0) as u64)
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_microvm_guest_boots_under_qemu_and_its_agent_serves_over_vsock() {
    space_process::become_subreaper().unwrap();
    let shared = DataDir::open(&shared_data_dir()).expect("the shared test data dir: run scripts/test.sh");
    let guest = space_host::guest::existing(&shared).expect("guest artifacts: run `space setup` (scripts/test.sh)");
    // QEMU loads the bzImage Debian ships (Firecracker the ELF unpacked from it).
    let bzimage = space_host::guest::guest_dir(&shared).join("vmlinuz");
    let data = TestDataDir::new();
    let dir = data.root().join("qemu");
    std::fs::create_dir_all(&dir).unwrap();
    let base = data.data.template(BASE_TEMPLATE).unwrap();
    let drive = dir.join("root.ext4");
    space_host::template::make_ext4(&base.rootfs(), &drive, 64).unwrap();

    let vm = Vm::boot(&dir, &bzimage, &guest.initramfs, &drive, &[]).await;
    let (listener, console) = (&vm.listener, &vm.console);
    let qemu = vm.qemu();

    // The first sandbox: the agent booted the root drive and dialed home.
    let socket = accept(listener, "boot", console, qemu).await;
    let first = spec("sbx_guest_a", &[("ROLE", "first")]);
    let agent = AgentConn::handshake(socket, space_engine::welcome_for(&first), PATIENCE).await.expect("handshake");
    assert_eq!(agent.hello().pid, 1, "the agent is PID 1");
    assert_eq!(sh(&agent, "uname -r").await.trim(), guest.release, "Debian's kernel from `space setup`");
    let mounts = sh(&agent, "cat /proc/mounts").await;
    assert!(mounts.lines().any(|l| l.starts_with("/dev/vda / ext4 ")), "the root drive is /: {mounts}");
    assert_eq!(sh(&agent, "test -e /modules.order || echo switched").await, "switched\n", "the initramfs is gone");
    assert_eq!(sh(&agent, "test -x /usr/bin/python3 && echo template").await, "template\n");
    let loaded = sh(&agent, "cat /proc/modules").await;
    for module in ["virtio_blk", "vmw_vsock_virtio_transport"] {
        assert!(loaded.contains(module), "{module} is loaded: {loaded}");
    }
    assert_eq!(sh(&agent, "hostname; echo $ROLE").await, "sbx-guest-a\nfirst\n", "its hostname and env");
    // The guest's own clock (its RTC) says 2001; its system clock is the host's.
    let rtc: u64 = sh(&agent, "cat /sys/class/rtc/rtc0/since_epoch").await.trim().parse().unwrap();
    assert!(rtc < 1_100_000_000, "the guest's RTC is far off: {rtc}");
    let guest_time: u64 = sh(&agent, "date +%s").await.trim().parse().unwrap();
    assert!(now().abs_diff(guest_time) < 10, "the agent set the clock from the host's: {guest_time} vs {}", now());
    let identity = space_engine::fresh_identity(&first.env, None).unwrap();
    agent.set_identity(&identity, PATIENCE).await.expect("fresh entropy taken");
    // Egress rides the same channel over vsock: the guest's loopback is up
    // and its proxy port reaches the host's handler (an echo here).
    agent.on_egress(std::sync::Arc::new(|stream: space_engine::EgressStream| {
        let (mut from_guest, mut to_guest) = tokio::io::split(stream.into_io());
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut from_guest, &mut to_guest).await;
        });
    }));
    let echoed = sh(
        &agent,
        "python3 -c \"import socket\ns = socket.create_connection(('127.0.0.1', 3128), timeout=30)\ns.sendall(b'over vsock')\nprint(s.recv(64).decode())\"",
    )
    .await;
    assert_eq!(echoed, "over vsock\n", "egress through the relay");

    // Quiesced, the agent lets go and dials again; welcomed as another
    // sandbox (as a clone of a template snapshot is), it becomes that one.
    let running = agent.exec(&common::request(&["sleep", "1000"])).await.expect("a command that outlives it");
    agent.quiesce(PATIENCE).await.expect("quiesce");
    let socket = accept(listener, "redial", console, qemu).await;
    let clone = spec("sbx_guest_b", &[("ROLE", "clone")]);
    let agent = AgentConn::handshake(socket, space_engine::welcome_for(&clone), PATIENCE).await.expect("handshake");
    assert!(agent.hello().reconnect, "it knows it is a redial");
    assert_eq!(sh(&agent, "hostname; echo $ROLE").await, "sbx-guest-b\nclone\n", "the new sandbox's identity");
    drop(running);

    let said = std::fs::read_to_string(console).unwrap();
    for failure in ["space-agent: setting", "space-agent: reseeding", "space-agent: mixing"] {
        assert!(!said.contains(failure), "the agent reported a failure ({failure}):\n{said}");
    }
}

/// A guest dir in `data` with the shared one's kernel and an initramfs of
/// this build's agent (`SPACE_AGENT_BIN`): the volume test needs the agent
/// that mounts volume drives, whatever the shared data dir was set up with.
fn guest_of_this_agent(shared: &DataDir, data: &DataDir) -> space_host::guest::GuestArtifacts {
    let (from, to) = (space_host::guest::guest_dir(shared), space_host::guest::guest_dir(data));
    std::fs::create_dir_all(&to).unwrap();
    for name in ["release", "vmlinux", "vmlinuz", "kernel-package"] {
        std::os::unix::fs::symlink(from.join(name), to.join(name)).unwrap();
    }
    space_host::guest::prepare(data, &space_testkit::agent_bin(), &|_| {}).expect("the initramfs of this agent")
}

/// A file's bytes in an ext4 image, read on the host without mounting it
/// (the journal replayed first: the guest was killed, not shut down).
fn file_in_image(image: &Path, path: &str) -> String {
    // Through the reaper: this test process reaps its children there.
    let fsck = Reaper::global().output(Command::new("e2fsck").args(["-fy"]).arg(image)).unwrap();
    let recovered = matches!(fsck.status, space_process::ExitStatus::Exited(0 | 1));
    assert!(recovered, "e2fsck: {}", String::from_utf8_lossy(&fsck.stdout));
    let out = space_host::run(Command::new("debugfs").args(["-R", &format!("cat {path}")]).arg(image)).unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// Firecracker's volumes are ext4 images attached as drives after the root
/// (decision 031). The engine tells the agent which drive goes where; the
/// agent mounts them (`nosuid,nodev`, `ro` for a read-only mount) before
/// it serves anything. What a guest writes and syncs is in the image when
/// the microVM is killed; a read-only drive refuses writes (the guest
/// kernel's `EROFS`, under it a read-only drive the VMM would refuse to
/// write too); and a link in a volume resolves in the guest's own tree.
#[tokio::test(flavor = "multi_thread")]
async fn volume_drives_are_mounted_by_the_agent_read_write_and_read_only() {
    space_process::become_subreaper().unwrap();
    let shared = DataDir::open(&shared_data_dir()).expect("the shared test data dir: run scripts/test.sh");
    let data = TestDataDir::new();
    let guest = guest_of_this_agent(&shared, &data.data);
    let bzimage = space_host::guest::guest_dir(&data.data).join("vmlinuz");
    let dir = data.root().join("qemu");
    std::fs::create_dir_all(&dir).unwrap();
    let base = data.data.template(BASE_TEMPLATE).unwrap();
    let root = dir.join("root.ext4");
    space_host::template::make_ext4(&base.rootfs(), &root, 64).unwrap();
    // The read-write volume: empty, as a Firecracker node makes one.
    let workspace = dir.join("workspace.ext4");
    space_host::template::make_volume_image(&workspace, 32).unwrap();
    // The read-only one holds a file.
    let seed = dir.join("seed");
    std::fs::create_dir_all(&seed).unwrap();
    std::fs::write(seed.join("kept"), "seeded\n").unwrap();
    let seeded = dir.join("seeded.ext4");
    space_host::template::make_ext4(&seed, &seeded, 8).unwrap();
    // A file only the host has, at a path the guest's links will try.
    let host_only = dir.join("host-only");
    std::fs::write(&host_only, "the host's\n").unwrap();

    let vm = Vm::boot(&dir, &bzimage, &guest.initramfs, &root, &[(&workspace, false), (&seeded, true)]).await;
    let socket = accept(&vm.listener, "boot", &vm.console, vm.qemu()).await;
    let mut sandbox = spec("sbx_guest_volumes", &[]);
    sandbox.volumes = vec![
        space_engine::VolumeMountSpec {
            volume: "vol_00000000000000000001".into(),
            path: "/workspace".into(),
            read_only: false,
        },
        space_engine::VolumeMountSpec {
            volume: "vol_00000000000000000002".into(),
            path: "/srv/seed".into(),
            read_only: true,
        },
    ];
    let mut welcome = space_engine::welcome_for(&sandbox);
    welcome.volumes = space_engine::firecracker::guest_volumes(&sandbox);
    assert_eq!(
        welcome.volumes.iter().map(|v| v.device.as_str()).collect::<Vec<_>>(),
        ["vdb", "vdc"],
        "the drives after the root, in the mounts' order"
    );
    let agent = AgentConn::handshake(socket, welcome, PATIENCE).await.expect("handshake");
    agent.ping(PATIENCE).await.expect("the agent serves once its volumes are mounted");

    let mounts = sh(&agent, "cat /proc/mounts").await;
    let options = |path: &str| -> Vec<String> {
        let line = mounts.lines().find(|l| l.split(' ').nth(1) == Some(path));
        let line = line.unwrap_or_else(|| panic!("{path} is not mounted: {mounts}"));
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields[2], "ext4", "{line}");
        fields[3].split(',').map(str::to_string).collect()
    };
    let (rw, ro) = (options("/workspace"), options("/srv/seed"));
    assert!(mounts.contains("/dev/vdb /workspace ") && mounts.contains("/dev/vdc /srv/seed "), "{mounts}");
    for (opts, mode) in [(&rw, "rw"), (&ro, "ro")] {
        for wanted in [mode, "nosuid", "nodev"] {
            assert!(opts.iter().any(|o| o == wanted), "{wanted} in {opts:?}");
        }
    }

    // Read-write: written and synced inside, in the image once the guest
    // is gone.
    sh(&agent, "echo written-inside > /workspace/hello && sync").await;
    // Read-only: the seed is there; a write, a new file and a truncation
    // are refused with EROFS and change nothing.
    assert_eq!(sh(&agent, "cat /srv/seed/kept").await, "seeded\n");
    for attempt in ["echo x > /srv/seed/new", ": > /srv/seed/kept", "rm /srv/seed/kept", "mkdir /srv/seed/d"] {
        let (_, err, exited) = common::run(&agent, &["sh", "-c", attempt]).await;
        assert_ne!(exited.exit_code, Some(0), "{attempt} succeeded");
        assert!(String::from_utf8_lossy(&err).contains("Read-only file system"), "{attempt}: {err:?}");
    }
    assert_eq!(sh(&agent, "cat /srv/seed/kept").await, "seeded\n", "the truncation changed nothing");

    // Links to /, .. and /proc/1/root in the volume: the guest's kernel
    // resolves them in the guest's own tree (the host never opens the
    // volume's files: the VMM only reads and writes the image's blocks),
    // so they reach the guest's root, never the host's.
    sh(&agent, "cd /workspace && ln -s / root && ln -s .. up && ln -s /proc/1/root init-root && sync").await;
    let marker = host_only.display().to_string();
    for link in ["root", "up", "init-root"] {
        let seen = sh(
            &agent,
            &format!("cat /workspace/{link}/etc/hostname; test -e /workspace/{link}{marker} || echo absent"),
        )
        .await;
        assert_eq!(seen, "sbx-guest-volumes\nabsent\n", "/workspace/{link} is the guest's root, not the host's");
    }
    assert_eq!(sh(&agent, "readlink -f /workspace/up/..").await, "/\n");

    // The guest goes as a killed microVM does: no unmount, no shutdown.
    drop(agent);
    drop(vm);
    assert_eq!(file_in_image(&workspace, "/hello"), "written-inside\n", "the write is in the volume's image");
    let out = space_host::run(Command::new("debugfs").args(["-R", "stat /root"]).arg(&workspace)).unwrap();
    assert!(String::from_utf8_lossy(&out).contains("Type: symlink"), "the link is a link in the image");
    assert_eq!(std::fs::read_to_string(&host_only).unwrap(), "the host's\n");

    // Booted again on the same image (its journal recovered by the mount),
    // then stopped as the host stops a microVM, by Ctrl-Alt-Del (here its
    // SIGINT to the agent, which is what the kernel turns it into; QEMU's
    // microvm tells the guest it has no keyboard controller, so the key
    // press itself is left to the Firecracker engine test): the
    // agent unmounts the volume before the guest ends, so a write never
    // synced is in the image and the file system is clean.
    let again = data.root().join("qemu-again");
    std::fs::create_dir_all(&again).unwrap();
    let vm = Vm::boot(&again, &bzimage, &guest.initramfs, &root, &[(&workspace, false), (&seeded, true)]).await;
    let socket = accept(&vm.listener, "second boot", &vm.console, vm.qemu()).await;
    let mut welcome = space_engine::welcome_for(&sandbox);
    welcome.volumes = space_engine::firecracker::guest_volumes(&sandbox);
    let agent = AgentConn::handshake(socket, welcome, PATIENCE).await.expect("handshake");
    assert_eq!(sh(&agent, "cat /workspace/hello").await, "written-inside\n", "the synced write outlived the kill");
    sh(&agent, "echo never-synced > /workspace/late").await;
    let _stopping = agent.exec(&common::request(&["sh", "-c", "kill -INT 1"])).await.expect("exec");
    let stopped = vm.qemu().wait_timeout(PATIENCE);
    assert!(stopped.is_some(), "the guest did not stop: {}", std::fs::read_to_string(&vm.console).unwrap());
    drop(agent);
    drop(vm);
    space_host::run(Command::new("e2fsck").arg("-fn").arg(&workspace)).expect("unmounted cleanly");
    assert_eq!(file_in_image(&workspace, "/late"), "never-synced\n", "the unsynced write is in the image");
}
