//! Firecracker's VMM side against a real binary: API, configuration,
//! InstanceStart, pause/resume, snapshot create and load into new
//! processes, the jailer and each VMM's cgroup, adoption by a new server,
//! bad configuration, cleanup. They need
//! `FIRECRACKER_BIN` (a jailer beside it for the jailer test); without it
//! each test skips with one line saying so. On these hosts `/dev/kvm` is
//! kvm_pvm, so the guest kernel does not come up: these tests check the
//! VMM, not the guest.

use std::path::{Path, PathBuf};

use space_engine::firecracker::api::{
    BootSource, Drive, MachineConfig, MemBackend, SnapshotCreate, SnapshotLoad, Vsock, VsockOverride,
};
use space_engine::firecracker::{find_jailer, Firecracker, FirecrackerConfig, FirecrackerHost, Vmm, VmmLimits};
use space_engine::privsep::proto::{DiskMib, MemoryMib, Shape, TemplateName, TemplateRef, TemplateVersion, Vcpus};
use space_engine::{Engine, LiveStatus, SandboxSpec};
use space_host::datadir::DataDir;
use space_testkit::{shared_data_dir, TestDataDir};

fn firecracker(test: &str) -> Option<PathBuf> {
    match std::env::var_os("FIRECRACKER_BIN").map(PathBuf::from) {
        Some(path) if path.is_file() => Some(path),
        Some(path) => panic!("FIRECRACKER_BIN={} is not a file", path.display()),
        None => {
            skip(&format!("{test}: FIRECRACKER_BIN is not set; Firecracker's VMM tests need a firecracker binary"));
            None
        }
    }
}

/// One line on the real stderr (the test harness captures `eprintln!`), so
/// a skip is seen in every run.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}

/// The guest kernel and initramfs `space setup` built in the shared data dir.
fn guest() -> (PathBuf, PathBuf) {
    let shared = DataDir::open(&shared_data_dir()).expect("the shared test data dir: run scripts/test.sh");
    let guest = space_host::guest::existing(&shared).expect("guest artifacts: run `space setup` (scripts/test.sh)");
    (guest.kernel, guest.initramfs)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Configures a VM with the Debian guest kernel, the root drive `root`
/// (1 MiB of zeros unless it exists) and vsock at `vsock`.
async fn configure(vmm: &Vmm, root: &Path, vsock: &Path) {
    let (kernel, initrd) = guest();
    configure_with(vmm, (kernel, initrd), root, vsock).await;
}

/// [`configure`] with the kernel and initramfs as the VMM names them.
async fn configure_with(vmm: &Vmm, (kernel, initrd): (PathBuf, PathBuf), root: &Path, vsock: &Path) {
    if !vmm_path(vmm, root).exists() {
        std::fs::write(vmm_path(vmm, root), vec![0u8; 1 << 20]).unwrap();
    }
    vmm.api
        .boot_source(&BootSource {
            kernel_image_path: kernel,
            initrd_path: Some(initrd),
            boot_args: "console=ttyS0 reboot=k panic=1 pci=off".into(),
        })
        .await
        .unwrap();
    vmm.api
        .machine_config(&MachineConfig { vcpu_count: 1, mem_size_mib: 128, smt: false, track_dirty_pages: false })
        .await
        .unwrap();
    vmm.api
        .drive(&Drive {
            drive_id: "root".into(),
            path_on_host: root.to_path_buf(),
            is_root_device: true,
            is_read_only: false,
        })
        .await
        .unwrap();
    vmm.api.vsock(&Vsock { guest_cid: 3, uds_path: vsock.to_path_buf() }).await.unwrap();
}

/// A path as the (unjailed) VMM resolves it: relative ones from its
/// directory, which holds its API socket.
fn vmm_path(vmm: &Vmm, path: &Path) -> PathBuf {
    vmm.api.socket().parent().unwrap().join(path)
}

/// A VMM with the guest configured and InstanceStart done.
async fn started_vmm(binary: &Path, dir: &Path, id: &str) -> Vmm {
    let vmm = Vmm::spawn(binary, dir, id).await.unwrap();
    configure(&vmm, &dir.join("root.ext4"), &dir.join("vsock.sock")).await;
    vmm.api.start().await.unwrap();
    vmm
}

/// A template version `templates/tiny/1` with a small ext4 root drive and
/// the default shape 1 vCPU, 128 MiB, 16 MiB of disk.
fn tiny_template(data: &TestDataDir) -> PathBuf {
    let template = data.root().join("templates/tiny/1");
    std::fs::create_dir_all(template.join("rootfs/etc")).unwrap();
    std::fs::write(template.join("rootfs/etc/hostname"), "tiny\n").unwrap();
    space_host::template::make_ext4(&template.join("rootfs"), &template.join("rootfs.ext4"), 16).unwrap();
    let meta = serde_json::json!({
        "name": "tiny", "version": 1, "created_at": "2026-12-02T00:00:00Z", "source": {},
        "defaults": {"vcpus": 1, "memory_mib": 128, "disk_mib": 16, "env": {}, "workdir": "/", "user": "root"},
    });
    std::fs::write(template.join("template.json"), meta.to_string()).unwrap();
    template
}

fn engine_config(binary: &Path, jailer: Option<PathBuf>, data: &TestDataDir) -> FirecrackerConfig {
    let (kernel, initramfs) = guest();
    FirecrackerConfig {
        firecracker: binary.to_path_buf(),
        kernel,
        initramfs,
        jailer,
        jail_base: data.root().join("jail"),
        jail_uid: space_engine::firecracker::JAIL_UID,
        data_dir: data.root().to_path_buf(),
        // The guest does not come up on these hosts: fail fast.
        boot_patience: if space_host::hardware_virtualization() {
            space_engine::firecracker::BOOT_PATIENCE
        } else {
            std::time::Duration::from_secs(3)
        },
    }
}

/// The engine with its root work done each way there is: in this
/// process, and by a helper serving a [`FirecrackerHost`] on a socket (as
/// `space helper` does for a confined server), whose runtime comes along.
fn ways(
    config: &FirecrackerConfig,
    data: &TestDataDir,
) -> Vec<(&'static str, Firecracker, Option<tokio::runtime::Runtime>)> {
    let helper = runtime();
    let socket = data.root().join(format!("helper-{}.sock", config.jailer.is_some()));
    let _ = std::fs::remove_file(&socket);
    let listener = helper.block_on(async { space_engine::privsep::peer::HelperListener::bind(&socket, 0) }).unwrap();
    let engines = space_engine::helper::Engines {
        gvisor: None,
        firecracker: Some(std::sync::Arc::new(FirecrackerHost::new(config.clone()))),
    };
    helper.spawn(space_engine::helper::serve_engines(listener, engines, None));
    let through = Firecracker::through_helper(data.root(), &socket, 0, config.boot_patience);
    vec![("in process", Firecracker::new(config.clone()), None), ("through the helper", through, Some(helper))]
}

/// The tiny template's reference and the shape of its sandboxes.
fn tiny_ref() -> TemplateRef {
    TemplateRef { name: TemplateName::parse("tiny").unwrap(), version: TemplateVersion::new(1).unwrap() }
}

fn shape_of(spec: &SandboxSpec) -> Shape {
    Shape {
        vcpus: Vcpus::new(spec.vcpus).unwrap(),
        memory_mib: MemoryMib::new(spec.memory_mib).unwrap(),
        disk_mib: DiskMib::new(spec.disk_mib).unwrap(),
    }
}

/// A sandbox of `template`, with its default shape unless `memory_mib`
/// and `disk_mib` say otherwise.
fn sandbox(data: &TestDataDir, template: &Path, id: &str, memory_mib: u32, disk_mib: u32) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        dir: data.data.sandbox_dir(id),
        template_rootfs: template.join("rootfs"),
        hostname: id.into(),
        vcpus: 1,
        memory_mib,
        disk_mib,
        env: Default::default(),
        workdir: None,
        user: None,
        engine: None,
        trust_pem: None,
        volumes: Vec::new(),
    }
}

/// What an engine test needs: the binary, a data dir with a tiny
/// template, and the ways to run VMMs — jailed (with the jailer beside the
/// binary; a loud line when there is none) and not.
fn engine_test(test: &str) -> Option<(PathBuf, TestDataDir, PathBuf, Vec<Option<PathBuf>>)> {
    let binary = firecracker(test)?;
    let jailer = find_jailer(None, Some(&binary));
    if jailer.is_none() {
        skip(&format!("{test} (the jailed half): no jailer beside FIRECRACKER_BIN"));
    }
    let data = TestDataDir::new();
    let template = tiny_template(&data);
    Some((binary, data, template, vec![jailer, None]))
}

/// The sandbox's error when the guest cannot come up here, or its agent.
async fn expect_agent_or_no_guest(created: Result<space_engine::Started, space_engine::EngineError>, what: &str) {
    if space_host::hardware_virtualization() {
        let started = created.expect("the microVM runs and its agent answers");
        assert!(started.agent.ping(std::time::Duration::from_secs(5)).await.is_ok());
    } else {
        // Everything before the guest (paths, owners, sockets, ids, the
        // VMM's API) worked; only the guest cannot come up on kvm_pvm.
        let err = created.err().expect("no guest on this host").to_string();
        assert!(err.contains("did not dial home"), "{what}: it failed before the agent: {err}");
    }
}

/// Nothing of the sandbox is left: its dir, its jail (under whatever the
/// binary is named), the jailer's log, its cgroup, its VMM.
fn assert_gone(data: &TestDataDir, spec: &SandboxSpec) {
    let dashed = spec.id.replace('_', "-");
    let jails = data.root().join("jail");
    assert!(!spec.dir.exists(), "the sandbox dir is gone");
    for binary in std::fs::read_dir(&jails).into_iter().flatten().flatten() {
        assert!(!binary.path().join(&dashed).exists(), "the jail is gone: {}", binary.path().display());
    }
    assert!(!jails.join(format!("{dashed}.jailer.log")).exists(), "the jailer's log is gone");
    assert_eq!(space_testkit::sandbox_cgroups(&dashed), Vec::<PathBuf>::new(), "its cgroup is gone");
    assert_eq!(space_testkit::processes_mentioning(&dashed), 0, "no VMM is left");
}

fn cgroup_v2() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

/// The cgroups process `pid` is in, from `/proc/PID/cgroup`: (controllers,
/// path) per hierarchy (v2's has no controllers).
fn cgroups_of(pid: i32) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            Some((controllers.to_string(), path.to_string()))
        })
        .collect()
}

/// The path of `pid`'s cgroup in the hierarchy of `controller` (v1), or
/// in v2's (None).
fn cgroup_of(pid: i32, controller: Option<&str>) -> Option<String> {
    cgroups_of(pid).into_iter().find_map(|(controllers, path)| match controller {
        Some(controller) => controllers.split(',').any(|c| c == controller).then_some(path),
        None => controllers.is_empty().then_some(path),
    })
}

/// A jailed VMM is in its own cgroup `space/<id>` — CPU (and, on v1, CPU
/// accounting), memory and tasks — holding it to `limits`: what its
/// `/proc/PID/cgroup` and the cgroup's limit files say.
fn assert_in_its_cgroup(pid: i32, id: &str, limits: VmmLimits) {
    use space_engine::firecracker::{VMM_OVERHEAD_MIB, VMM_OWN_TASKS};
    let expected = format!("/space/{id}");
    let read =
        |path: String| std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")).trim().to_string();
    let memory = ((limits.memory_mib + VMM_OVERHEAD_MIB) as u64) << 20;
    let (quota, tasks) = (u64::from(limits.vcpus) * 100_000, (limits.vcpus + VMM_OWN_TASKS).to_string());
    if cgroup_v2() {
        assert_eq!(cgroup_of(pid, None).as_deref(), Some(expected.as_str()), "{:?}", cgroups_of(pid));
        let dir = format!("/sys/fs/cgroup/space/{id}");
        assert_eq!(read(format!("{dir}/cpu.max")), format!("{quota} 100000"), "the CPU of its vCPUs");
        assert_eq!(read(format!("{dir}/memory.max")), memory.to_string(), "its memory and the VMM's");
        assert_eq!(read(format!("{dir}/pids.max")), tasks, "its tasks");
        return;
    }
    for controller in ["cpu", "cpuacct", "memory", "pids"] {
        let path = cgroup_of(pid, Some(controller));
        assert_eq!(path.as_deref(), Some(expected.as_str()), "{controller}: {:?}", cgroups_of(pid));
    }
    let dir = |controller: &str| format!("/sys/fs/cgroup/{controller}/space/{id}");
    assert_eq!(read(format!("{}/cpu.cfs_period_us", dir("cpu"))), "100000");
    assert_eq!(read(format!("{}/cpu.cfs_quota_us", dir("cpu"))), quota.to_string(), "the CPU of its vCPUs");
    assert_eq!(
        read(format!("{}/memory.limit_in_bytes", dir("memory"))),
        memory.to_string(),
        "its memory and the VMM's"
    );
    if Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists() {
        assert_eq!(
            read(format!("{}/memory.memsw.limit_in_bytes", dir("memory"))),
            memory.to_string(),
            "and no more swapped"
        );
    }
    assert_eq!(read(format!("{}/pids.max", dir("pids"))), tasks, "its tasks");
}

/// Puts process `pid` into a cgroup v1 freezer of its own and freezes it;
/// None where there is no v1 freezer.
fn freeze(pid: i32) -> Option<PathBuf> {
    let hierarchy = Path::new("/sys/fs/cgroup/freezer");
    if !hierarchy.join("tasks").exists() {
        return None;
    }
    let dir = hierarchy.join(format!("space-test-frozen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
    std::fs::write(dir.join("freezer.state"), "FROZEN").unwrap();
    space_testkit::wait_for("the VMM frozen", space_testkit::PATIENCE, || {
        (std::fs::read_to_string(dir.join("freezer.state")).unwrap_or_default().trim() == "FROZEN").then_some(())
    });
    Some(dir)
}

/// Whether SIGKILL is pending for `pid` (sent, not yet acted on).
fn kill_pending(pid: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .filter_map(|line| line.strip_prefix("ShdPnd:").or_else(|| line.strip_prefix("SigPnd:")))
        .any(|mask| u64::from_str_radix(mask.trim(), 16).is_ok_and(|mask| mask & (1 << (nix::libc::SIGKILL - 1)) != 0))
}

fn gone(pid: i32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
        || std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| s.contains("State:\tZ"))
}

#[test]
fn firecracker_vmm_answers_its_api_and_leaves_nothing_behind() {
    let Some(binary) = firecracker("firecracker_vmm_answers_its_api_and_leaves_nothing_behind") else { return };
    let data = TestDataDir::new();
    let dir = data.root().join("vmm");
    runtime().block_on(async {
        let mut vmm = Vmm::spawn(&binary, &dir, "space-test-api").await.unwrap();
        let info = vmm.api.instance_info().await.unwrap();
        assert_eq!(
            (info.app_name.as_str(), info.id.as_str(), info.state.as_str()),
            ("Firecracker", "space-test-api", "Not started")
        );
        eprintln!("firecracker API ready {:?} after spawn ({})", vmm.ready_after, info.vmm_version);
        let (pid, socket) = (vmm.pid(), vmm.api.socket().to_path_buf());
        vmm.kill().await;
        assert!(gone(pid), "the VMM process is gone");
        assert!(!socket.exists(), "its API socket is removed");
    });
}

#[test]
fn firecracker_configures_starts_pauses_and_resumes() {
    let Some(binary) = firecracker("firecracker_configures_starts_pauses_and_resumes") else { return };
    let data = TestDataDir::new();
    let dir = data.root().join("vmm");
    runtime().block_on(async {
        let vmm = started_vmm(&binary, &dir, "space-test-run").await;
        assert_eq!(vmm.api.instance_info().await.unwrap().state, "Running");
        vmm.api.pause().await.unwrap();
        assert_eq!(vmm.api.instance_info().await.unwrap().state, "Paused");
        vmm.api.resume().await.unwrap();
        assert_eq!(vmm.api.instance_info().await.unwrap().state, "Running");
    });
}

#[test]
fn firecracker_refuses_bad_configuration_with_its_reason() {
    let Some(binary) = firecracker("firecracker_refuses_bad_configuration_with_its_reason") else { return };
    let data = TestDataDir::new();
    let dir = data.root().join("vmm");
    runtime().block_on(async {
        let vmm = Vmm::spawn(&binary, &dir, "space-test-bad").await.unwrap();
        let zero = MachineConfig { vcpu_count: 0, mem_size_mib: 128, smt: false, track_dirty_pages: false };
        let err = vmm.api.machine_config(&zero).await.unwrap_err().to_string();
        assert!(err.contains("firecracker refused PUT /machine-config (400"), "{err}");
        let missing = Drive {
            drive_id: "root".into(),
            path_on_host: dir.join("no-such-image"),
            is_root_device: true,
            is_read_only: false,
        };
        let err = vmm.api.drive(&missing).await.unwrap_err().to_string();
        assert!(err.contains("400"), "{err}");
        let err = vmm.api.start().await.unwrap_err().to_string();
        assert!(err.contains("PUT /actions"), "starting without a kernel is refused: {err}");
        assert_eq!(vmm.api.instance_info().await.unwrap().state, "Not started");
    });
}

#[test]
fn firecracker_snapshot_loads_into_new_processes() {
    let Some(binary) = firecracker("firecracker_snapshot_loads_into_new_processes") else { return };
    let data = TestDataDir::new();
    let dir = data.root().join("vmm");
    runtime().block_on(async {
        let vmm = started_vmm(&binary, &dir, "space-test-snap").await;
        vmm.api.pause().await.unwrap();
        let (state, memory) = (dir.join("vm.state"), dir.join("vm.mem"));
        vmm.api
            .snapshot_create(&SnapshotCreate {
                snapshot_type: "Full",
                snapshot_path: state.clone(),
                mem_file_path: memory.clone(),
            })
            .await
            .unwrap();
        assert!(state.is_file() && std::fs::metadata(&memory).unwrap().len() == 128 << 20);
        drop(vmm);
        // Two clones of the one snapshot, each in its own process.
        for n in 0..2 {
            let clone_dir = data.root().join(format!("clone-{n}"));
            let clone = Vmm::spawn(&binary, &clone_dir, &format!("space-test-clone-{n}")).await.unwrap();
            let load = SnapshotLoad {
                snapshot_path: state.clone(),
                mem_backend: MemBackend { backend_type: "File", backend_path: memory.clone() },
                resume_vm: false,
                vsock_override: Some(VsockOverride { uds_path: clone_dir.join("vsock.sock") }),
            };
            clone.api.snapshot_load(&load).await.unwrap();
            assert_eq!(clone.api.instance_info().await.unwrap().state, "Paused");
        }
    });
}

#[test]
fn firecracker_runs_under_the_jailer_as_its_own_user_in_its_own_cgroup() {
    let test = "firecracker_runs_under_the_jailer_as_its_own_user_in_its_own_cgroup";
    let Some(binary) = firecracker(test) else { return };
    let Some(jailer) = find_jailer(None, Some(&binary)) else {
        skip(&format!("{test}: no jailer beside FIRECRACKER_BIN"));
        return;
    };
    let data = TestDataDir::new();
    let base = data.root().join("jail");
    runtime().block_on(async {
        let limits = VmmLimits { vcpus: 2, memory_mib: 256 };
        let mut vmm =
            Vmm::spawn_jailed(&jailer, &binary, &base, "space-test-jail", 65534, 65534, limits).await.unwrap();
        assert_eq!(vmm.api.instance_info().await.unwrap().state, "Not started");
        let status = std::fs::read_to_string(format!("/proc/{}/status", vmm.pid())).unwrap();
        let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert!(uid.split_whitespace().nth(1) == Some("65534"), "the VMM runs as its own user: {uid}");
        // Its root is the jail: the API socket is there, the host's /etc is not.
        let root = PathBuf::from(format!("/proc/{}/root", vmm.pid()));
        assert!(root.join("api.sock").exists() && !root.join("etc/passwd").exists(), "the VMM is chrooted");
        // A dynamically linked build runs there on the libraries put in
        // for it (a static one needs none).
        let libraries = space_engine::firecracker::shared_libraries(&binary).unwrap();
        for library in &libraries {
            assert!(root.join(library.strip_prefix("/").unwrap()).is_file(), "{} is in the jail", library.display());
        }
        let linked = if libraries.is_empty() { "static" } else { "dynamic" };
        eprintln!("a {linked} firecracker ran under the jailer with {} libraries", libraries.len());
        // Its own cgroup, beside the gVisor sandboxes': the CPU of its
        // vCPUs, its memory and the VMM's own, a task cap.
        assert_in_its_cgroup(vmm.pid(), "space-test-jail", limits);
        let pid = vmm.pid();
        vmm.kill().await;
        assert!(gone(pid));
        assert!(!base.join("firecracker/space-test-jail").exists(), "the jail is removed");
        assert!(!base.join("space-test-jail.jailer.log").exists(), "and the jailer's log");
        assert_eq!(space_testkit::sandbox_cgroups("space-test-jail"), Vec::<PathBuf>::new(), "and its cgroup");
    });
}

/// Starting a jailed VMM and killing one wait without holding the async
/// thread: on a runtime of one thread, another task goes on meanwhile —
/// here the one each waits for. The jailer starts only once a task has
/// seen it begin; a VMM frozen (cgroup v1 freezer) dies of its SIGKILL only
/// once a task has seen it sent and thawed it.
#[test]
fn firecracker_jailer_start_and_kill_leave_the_async_thread_free() {
    let test = "firecracker_jailer_start_and_kill_leave_the_async_thread_free";
    let Some(binary) = firecracker(test) else { return };
    let Some(jailer) = find_jailer(None, Some(&binary)) else {
        skip(&format!("{test}: no jailer beside FIRECRACKER_BIN"));
        return;
    };
    let data = TestDataDir::new();
    let base = data.root().join("jail");
    let (begun, word) = (data.root().join("jailer-begun"), data.root().join("jailer-go"));
    // Gives up after about 2 s, before the engine's own patience (5 s).
    let gated = data.root().join("gated-jailer");
    let script = format!(
        "#!/bin/sh\ntouch '{}'\nfor _ in $(seq 200); do\n  [ -e '{}' ] && exec '{}' \"$@\"\n  sleep 0.01\ndone\nexit 1\n",
        begun.display(),
        word.display(),
        jailer.display()
    );
    std::fs::write(&gated, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&gated, std::fs::Permissions::from_mode(0o755)).unwrap();
    let one_thread = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    one_thread.block_on(async {
        let say_go = async {
            let deadline = std::time::Instant::now() + space_testkit::PATIENCE;
            while !begun.exists() && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            std::fs::write(&word, "").unwrap();
        };
        let limits = VmmLimits { vcpus: 1, memory_mib: 128 };
        let (spawned, ()) =
            tokio::join!(Vmm::spawn_jailed(&gated, &binary, &base, "space-test-free", 65534, 65534, limits), say_go);
        let mut vmm = spawned.expect("the jailer ran once the other task let it");
        let pid = vmm.pid();
        let Some(freezer) = freeze(pid) else {
            skip(&format!("{test} (the kill half): no cgroup v1 freezer here"));
            vmm.kill().await;
            return;
        };
        let thaw_once_killed = async {
            let deadline = std::time::Instant::now() + space_testkit::PATIENCE;
            while !kill_pending(pid) && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            std::fs::write(freezer.join("freezer.state"), "THAWED").unwrap();
        };
        let kill = async {
            vmm.kill().await;
            (gone(pid), space_testkit::sandbox_cgroups("space-test-free"))
        };
        let ((gone_when_killed, cgroups), ()) = tokio::join!(kill, thaw_once_killed);
        space_testkit::wait_for("the freezer cgroup empty", space_testkit::PATIENCE, || {
            std::fs::remove_dir(&freezer).ok()
        });
        assert!(gone_when_killed, "the kill waited for the VMM while the other task thawed it");
        assert_eq!(cgroups, Vec::<PathBuf>::new(), "and removed its cgroup once it was gone");
    });
}

#[test]
fn firecracker_engine_boots_a_microvm_jailed_and_not_and_waits_for_its_agent() {
    let test = "firecracker_engine_boots_a_microvm_jailed_and_not_and_waits_for_its_agent";
    let Some((binary, data, template, jailers)) = engine_test(test) else { return };
    for jailer in jailers {
        let jailed = jailer.is_some();
        let config = engine_config(&binary, jailer, &data);
        for (how, engine, _helper) in ways(&config, &data) {
            // Not the template's shape (more memory and disk): a cold boot, on
            // a root drive grown by the extra disk.
            let id = if jailed { "sbx_00000000000000000f01" } else { "sbx_00000000000000000f02" };
            let spec = sandbox(&data, &template, id, 256, 48);
            let host = FirecrackerHost::new(config.clone());
            assert!(host.clone_base_dir(&tiny_ref(), shape_of(&spec)).is_none(), "not the template's shape: no clone");
            runtime().block_on(async {
                expect_agent_or_no_guest(engine.create(&spec).await, &format!("jailed {jailed}, {how}")).await;
                engine.destroy(&spec).await.unwrap();
                assert_gone(&data, &spec);
            });
        }
    }
}

/// A file's bytes in an ext4 image, read without mounting it (its journal
/// replayed first).
fn file_in_image(image: &Path, path: &str) -> String {
    let fsck =
        space_process::Reaper::global().output(std::process::Command::new("e2fsck").arg("-fy").arg(image)).unwrap();
    assert!(matches!(fsck.status, space_process::ExitStatus::Exited(0 | 1)), "e2fsck: {fsck:?}");
    let cat = std::process::Command::new("debugfs").args(["-R", &format!("cat {path}")]).arg(image).output();
    String::from_utf8_lossy(&cat.unwrap().stdout).into_owned()
}

/// Volumes on Firecracker (decision 031): an image volume mounted
/// read-write and another read-only are drives of the microVM, jailed and
/// not, in process and through the helper; the agent mounts them; a write
/// never synced reaches the image when the sandbox is destroyed (its
/// agent unmounts them on Ctrl-Alt-Del); a write to the read-only one is
/// EROFS. Without hardware virtualization everything before the guest
/// (the images, copies, binds into the jail) must still work and leave
/// nothing behind.
#[test]
fn firecracker_engine_mounts_image_volumes_jailed_and_not() {
    use space_engine::volumes::{LocalVolumes, VolumeHost};
    let test = "firecracker_engine_mounts_image_volumes_jailed_and_not";
    let Some((binary, data, template, jailers)) = engine_test(test) else { return };
    let layout = space_engine::privsep::layout::Layout::new(data.root());
    let volumes = LocalVolumes::new(layout.clone(), space_testkit::space_bin());
    let (workspace, seed) = (
        space_engine::privsep::proto::VolumeId::parse("vol_000000000000000f0a01").unwrap(),
        space_engine::privsep::proto::VolumeId::parse("vol_000000000000000f0a02").unwrap(),
    );
    volumes.create_image_volume(&workspace, DiskMib::new(32).unwrap()).unwrap();
    volumes.create_image_volume(&seed, DiskMib::new(16).unwrap()).unwrap();
    let mut round = 0;
    for jailer in jailers {
        let jailed = jailer.is_some();
        let config = engine_config(&binary, jailer, &data);
        for (how, engine, _helper) in ways(&config, &data) {
            round += 1;
            let id = format!("sbx_000000000000000f0b{round:02x}");
            let mut spec = sandbox(&data, &template, &id, 256, 48);
            spec.volumes = vec![
                space_engine::VolumeMountSpec {
                    volume: workspace.to_string(),
                    path: "/workspace".into(),
                    read_only: false,
                },
                space_engine::VolumeMountSpec { volume: seed.to_string(), path: "/seed".into(), read_only: true },
            ];
            let what = format!("jailed {jailed}, {how}");
            runtime().block_on(async {
                let created = engine.create(&spec).await;
                if space_host::hardware_virtualization() {
                    let agent = created.expect("the microVM runs with its volumes").agent;
                    let run = |line: String| {
                        let agent = &agent;
                        async move {
                            let request = space_proto::ExecRequest {
                                argv: vec!["sh".into(), "-c".into(), line],
                                env: Default::default(),
                                cwd: None,
                                user: None,
                                stdin: false,
                                tty: false,
                            };
                            let mut stream = agent.exec(&request).await.expect("exec");
                            let mut out = Vec::new();
                            while let Some(space_engine::ExecEvent::Stdout(b) | space_engine::ExecEvent::Stderr(b)) =
                                stream.next().await
                            {
                                out.extend(b);
                            }
                            String::from_utf8_lossy(&out).into_owned()
                        }
                    };
                    run(format!("echo {round} > /workspace/round")).await;
                    let refused = run("echo x > /seed/new".into()).await;
                    assert!(refused.contains("Read-only file system"), "{what}: {refused}");
                } else {
                    let err = created.err().expect("no guest on this host").to_string();
                    assert!(err.contains("did not dial home"), "{what}: it failed before the agent: {err}");
                }
                engine.destroy(&spec).await.unwrap();
                assert_gone(&data, &spec);
            });
            if space_host::hardware_virtualization() {
                let written = file_in_image(&layout.volume_image(&workspace), "/round");
                assert_eq!(written, format!("{round}\n"), "{what}: the unsynced write reached the image");
            }
        }
    }
    for volume in [&workspace, &seed] {
        let image = layout.volume_image(volume);
        let fsck = space_process::Reaper::global().output(std::process::Command::new("e2fsck").arg("-fy").arg(&image));
        assert!(matches!(fsck.unwrap().status, space_process::ExitStatus::Exited(0 | 1)), "{volume} is whole");
    }
}

#[test]
fn firecracker_engine_clones_a_template_snapshot_jailed_and_not() {
    use std::os::unix::fs::MetadataExt;
    let test = "firecracker_engine_clones_a_template_snapshot_jailed_and_not";
    let Some((binary, data, template, jailers)) = engine_test(test) else { return };
    for (jailer, (how, engine, _helper)) in jailers.into_iter().flat_map(|jailer| {
        let config = engine_config(&binary, jailer.clone(), &data);
        ways(&config, &data).into_iter().map(move |way| (jailer.clone(), way))
    }) {
        let jailed = jailer.is_some();
        let config = engine_config(&binary, jailer, &data);
        let (a, b) = (
            sandbox(&data, &template, "sbx_0000000000000000c1a0", 128, 16),
            sandbox(&data, &template, "sbx_0000000000000000c1b0", 128, 16),
        );
        let snapshot = FirecrackerHost::new(config.clone())
            .clone_base_dir(&tiny_ref(), shape_of(&a))
            .expect("the template's shape: a clone");
        let way = format!("{jailed}, {how}");
        runtime().block_on(async {
            if space_host::hardware_virtualization() {
                // The engine boots the template once and saves it.
                expect_agent_or_no_guest(engine.create(&a).await, "the first clone").await;
                engine.destroy(&a).await.unwrap();
            } else {
                // The guest cannot boot here: save a started VM by hand,
                // the way the engine does (paths relative to the VMM's dir).
                save_by_hand(&binary, &template, &snapshot, &data.root().join("saving")).await;
            }
            let memory = std::fs::metadata(snapshot.join("vm.mem")).unwrap();
            // Two clones at once: each its own VMM (and uid when jailed), both
            // mapping the one memory file privately.
            // While they run: what each VMM maps, its uid, and (jailed) its
            // cgroup and what the engine reads of it.
            let watch = async {
                let mut seen = Vec::new();
                for _ in 0..500 {
                    seen = [&a, &b].iter().filter_map(|spec| mapping(spec, memory.ino())).collect();
                    if seen.len() == 2 {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                for spec in [&a, &b] {
                    let Some(pid) = std::fs::read_to_string(spec.dir.join("vmm.pid")).ok() else { continue };
                    let (pid, dashed) = (pid.trim().parse().unwrap(), spec.id.replace('_', "-"));
                    let used = engine.resource_use(spec);
                    if jailed {
                        // The template's shape: 1 vCPU, 128 MiB.
                        assert_in_its_cgroup(pid, &dashed, VmmLimits { vcpus: 1, memory_mib: 128 });
                        let used = used.expect("the engine reads a jailed VMM's use from its cgroup");
                        assert!(used.memory_bytes > 0, "{used:?}");
                    } else {
                        let memory = cgroup_of(pid, (!cgroup_v2()).then_some("memory"));
                        assert_ne!(
                            memory,
                            Some(format!("/space/{dashed}")),
                            "an unjailed VMM has no cgroup of its own"
                        );
                        assert!(used.is_none(), "so nothing is read of it");
                    }
                }
                seen
            };
            let (made_a, made_b, seen) = tokio::join!(engine.create(&a), engine.create(&b), watch);
            assert_eq!(seen.len(), 2, "jailed {way}: both clones map the template's memory file: {seen:?}");
            if jailed {
                assert_ne!(seen[0], seen[1], "each jailed VMM has its own uid");
                assert!(seen.iter().all(|uid| *uid >= space_engine::firecracker::JAIL_UID), "{seen:?}");
            }
            expect_agent_or_no_guest(made_a, &format!("jailed {way}, clone a")).await;
            expect_agent_or_no_guest(made_b, &format!("jailed {way}, clone b")).await;
            for spec in [&a, &b] {
                engine.destroy(spec).await.unwrap();
                assert_gone(&data, spec);
            }
            let kept = std::fs::metadata(snapshot.join("vm.mem")).unwrap();
            assert_eq!((kept.ino(), kept.len(), kept.mode() & 0o777), (memory.ino(), memory.len(), 0o644));
            assert!(snapshot.join("vm.state").is_file() && snapshot.join("rootfs.ext4").is_file());

            // Without a snapshot the engine makes one first; when that
            // fails nothing half-made is left.
            if !space_host::hardware_virtualization() {
                std::fs::remove_dir_all(&snapshot).unwrap();
                expect_agent_or_no_guest(engine.create(&a).await, "making the template snapshot").await;
                assert!(!snapshot.exists() && !snapshot.with_extension("building").exists());
                assert_gone(&data, &a);
                // Nor is the template's microVM: a sandbox of its own, gone.
                let left: Vec<_> = std::fs::read_dir(data.root().join("sandboxes")).unwrap().flatten().collect();
                assert!(left.is_empty(), "no template microVM is left: {left:?}");
            }
        });
    }
}

/// What the engine saves of a template's microVM, made from a started
/// (not booted) VM: its state, memory and root drive, in `snapshot`.
async fn save_by_hand(binary: &Path, template: &Path, snapshot: &Path, work: &Path) {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work).unwrap();
    std::fs::copy(template.join("rootfs.ext4"), work.join("rootfs.ext4")).unwrap();
    let vmm = Vmm::spawn(binary, work, "space-test-template").await.unwrap();
    configure(&vmm, Path::new("rootfs.ext4"), Path::new("vsock.sock")).await;
    vmm.api.start().await.unwrap();
    vmm.api.pause().await.unwrap();
    let create =
        SnapshotCreate { snapshot_type: "Full", snapshot_path: "vm.state".into(), mem_file_path: "vm.mem".into() };
    vmm.api.snapshot_create(&create).await.unwrap();
    drop(vmm);
    std::fs::create_dir_all(snapshot).unwrap();
    for name in ["vm.state", "vm.mem", "rootfs.ext4"] {
        std::fs::rename(work.join(name), snapshot.join(name)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(snapshot.join(name), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
}

/// The uid of the sandbox's VMM when it maps the file with inode `inode`
/// privately (a copy-on-write mapping, `p` in its permissions).
fn mapping(spec: &SandboxSpec, inode: u64) -> Option<u32> {
    let pid = std::fs::read_to_string(spec.dir.join("vmm.pid")).ok()?.trim().parse::<i32>().ok()?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mapped = maps.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() >= 5 && fields[1].ends_with('p') && fields[4] == inode.to_string()
    });
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uid = status.lines().find(|l| l.starts_with("Uid:"))?.split_whitespace().nth(1)?.parse().ok()?;
    mapped.then_some(uid)
}

/// Kills a VMM a test left on its own, if it still runs, when dropped.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if !gone(self.0) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// A copy of `binary` (and its jailer) named as Firecracker's release
/// archives name theirs: not ending in `firecracker`.
fn renamed(binary: &Path, data: &TestDataDir) -> (PathBuf, PathBuf) {
    let bin = data.root().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let (copy, jailer) = (bin.join("firecracker-v1.17.0-x86_64"), bin.join("jailer"));
    std::fs::copy(binary, &copy).unwrap();
    if let Some(original) = find_jailer(None, Some(binary)) {
        std::fs::copy(original, &jailer).unwrap();
    }
    (copy, jailer)
}

#[test]
fn firecracker_engine_adopts_a_vmm_a_previous_server_left_paused_then_suspends_and_restores_it() {
    let test = "firecracker_engine_adopts_a_vmm_a_previous_server_left_paused_then_suspends_and_restores_it";
    let Some((binary, data, template, jailers)) = engine_test(test) else { return };
    // Recognised as the configured binary, whatever its name.
    let (binary, renamed_jailer) = renamed(&binary, &data);
    for (jailer, (how, engine, _helper)) in jailers.into_iter().flat_map(|jailer| {
        let jailer = jailer.map(|_| renamed_jailer.clone());
        let config = engine_config(&binary, jailer.clone(), &data);
        ways(&config, &data).into_iter().map(move |way| (jailer.clone(), way))
    }) {
        let jailed = jailer.is_some();
        let config = engine_config(&binary, jailer.clone(), &data);
        let id = if jailed { "sbx_000000000000000ad0a1" } else { "sbx_000000000000000ad0a2" };
        let spec = sandbox(&data, &template, id, 128, 16);
        std::fs::create_dir_all(&spec.dir).unwrap();
        std::fs::copy(template.join("rootfs.ext4"), spec.dir.join("rootfs.ext4")).unwrap();
        runtime().block_on(async {
            // What a previous server left: a started VMM (in the engine's
            // layout: its jail, or the sandbox dir), paused, and its pid file.
            let vmm = match &jailer {
                Some(jailer) => {
                    let uid = config.jail_uid + 7;
                    let root = Vmm::jail_root(&binary, &config.jail_base, &id.replace('_', "-"));
                    std::fs::create_dir_all(&root).unwrap();
                    std::fs::hard_link(spec.dir.join("rootfs.ext4"), root.join("rootfs.ext4")).unwrap();
                    std::os::unix::fs::chown(root.join("rootfs.ext4"), Some(uid), Some(uid)).unwrap();
                    std::fs::copy(&config.kernel, root.join("vmlinux")).unwrap();
                    std::fs::copy(&config.initramfs, root.join("initramfs.cpio")).unwrap();
                    let limits = VmmLimits { vcpus: 1, memory_mib: 128 };
                    let dashed = id.replace('_', "-");
                    let vmm =
                        Vmm::spawn_jailed(jailer, &binary, &config.jail_base, &dashed, uid, uid, limits).await.unwrap();
                    let guest = ("vmlinux".into(), "initramfs.cpio".into());
                    configure_with(&vmm, guest, Path::new("rootfs.ext4"), Path::new("vsock.sock")).await;
                    vmm
                }
                None => {
                    let vmm = Vmm::spawn(&binary, &spec.dir, &id.replace('_', "-")).await.unwrap();
                    configure(&vmm, Path::new("rootfs.ext4"), Path::new("vsock.sock")).await;
                    vmm
                }
            };
            vmm.api.start().await.unwrap();
            vmm.api.pause().await.unwrap();
            let pid = vmm.pid();
            std::fs::write(spec.dir.join("vmm.pid"), pid.to_string()).unwrap();
            std::mem::forget(vmm); // the old server is gone without stopping it
                                   // Should the test fail before the engine stops it: a jailed
                                   // VMM's command line does not name the data dir, whose cleanup
                                   // would miss it.
            let _stray = KillOnDrop(pid);

            assert_eq!(
                engine.status(&spec),
                LiveStatus::Paused,
                "jailed {jailed}, {how}: the new engine finds the VMM paused"
            );
            if jailed {
                let used = engine.resource_use(&spec).expect("read from the adopted VMM's cgroup");
                assert!(used.memory_bytes > 0, "{used:?}");
            }
            engine.resume(&spec).await.unwrap();
            assert_eq!(engine.status(&spec), LiveStatus::Running);
            engine.pause(&spec).await.unwrap();
            assert_eq!(engine.status(&spec), LiveStatus::Paused);
            engine.resume(&spec).await.unwrap();

            // Suspend: a full snapshot kept in the sandbox dir, the VMM gone.
            engine.suspend(&spec).await.unwrap();
            assert!(gone(pid), "suspend stops the VMM");
            let dashed = id.replace('_', "-");
            if jailed {
                let jail = Vmm::jail_root(&binary, &config.jail_base, &dashed);
                assert!(!jail.exists(), "and removes the adopted VMM's jail");
                assert!(!config.jail_base.join(format!("{dashed}.jailer.log")).exists(), "and its jailer's log");
                assert_eq!(space_testkit::sandbox_cgroups(&dashed), Vec::<PathBuf>::new(), "and its cgroup");
            }
            assert!(engine.has_snapshot(&spec), "the snapshot is kept");
            assert_eq!(engine.status(&spec), LiveStatus::Gone);
            let memory = std::fs::metadata(spec.dir.join("snapshot/vm.mem")).unwrap().len();
            assert_eq!(memory, 128 << 20, "the whole memory is saved");
            // Restore: loaded into a new VMM (a new jail and uid when jailed);
            // only the guest's redial cannot happen here.
            let restored = engine.restore(&spec).await;
            if space_host::hardware_virtualization() {
                restored.expect("the agent dials again");
            } else {
                let err = restored.expect_err("no guest on this host").to_string();
                assert!(err.contains("did not dial home"), "jailed {jailed}: the load failed: {err}");
            }
            engine.destroy(&spec).await.unwrap();
            assert_gone(&data, &spec);
        });
    }
}
