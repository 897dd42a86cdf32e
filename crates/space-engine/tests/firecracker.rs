//! Firecracker's VMM side against a real binary: API, configuration,
//! InstanceStart, pause/resume, snapshot create and load into new
//! processes, the jailer, bad configuration, cleanup. They need
//! `FIRECRACKER_BIN` (a jailer beside it for the jailer test); without it
//! each test skips with one line saying so. On these hosts `/dev/kvm` is
//! kvm_pvm, so the guest kernel does not come up: these tests check the
//! VMM, not the guest.

use std::path::{Path, PathBuf};

use space_engine::firecracker::api::{
    BootSource, Drive, MachineConfig, MemBackend, SnapshotCreate, SnapshotLoad, Vsock, VsockOverride,
};
use space_engine::firecracker::{find_jailer, Vmm};
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

/// Configures a VM with the Debian guest kernel, a root drive and vsock.
async fn configure(vmm: &Vmm, dir: &Path) {
    let (kernel, initrd) = guest();
    let root = dir.join("root.ext4");
    std::fs::write(&root, vec![0u8; 1 << 20]).unwrap();
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
        .drive(&Drive { drive_id: "root".into(), path_on_host: root, is_root_device: true, is_read_only: false })
        .await
        .unwrap();
    vmm.api.vsock(&Vsock { guest_cid: 3, uds_path: dir.join("vsock.sock") }).await.unwrap();
}

/// A VMM with the guest configured and InstanceStart done.
async fn started_vmm(binary: &Path, dir: &Path, id: &str) -> Vmm {
    let vmm = Vmm::spawn(binary, dir, id).await.unwrap();
    configure(&vmm, dir).await;
    vmm.api.start().await.unwrap();
    vmm
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
        vmm.kill();
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
fn firecracker_runs_under_the_jailer_as_its_own_user() {
    let Some(binary) = firecracker("firecracker_runs_under_the_jailer_as_its_own_user") else { return };
    let Some(jailer) = find_jailer(None, Some(&binary)) else {
        skip("firecracker_runs_under_the_jailer_as_its_own_user: no jailer beside FIRECRACKER_BIN");
        return;
    };
    let data = TestDataDir::new();
    let base = data.root().join("jail");
    runtime().block_on(async {
        let mut vmm = Vmm::spawn_jailed(&jailer, &binary, &base, "space-test-jail", 65534, 65534).await.unwrap();
        assert_eq!(vmm.api.instance_info().await.unwrap().state, "Not started");
        let status = std::fs::read_to_string(format!("/proc/{}/status", vmm.pid())).unwrap();
        let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert!(uid.split_whitespace().nth(1) == Some("65534"), "the VMM runs as its own user: {uid}");
        // Its root is the jail: the API socket is there, the host's /etc is not.
        let root = PathBuf::from(format!("/proc/{}/root", vmm.pid()));
        assert!(root.join("api.sock").exists() && !root.join("etc/passwd").exists(), "the VMM is chrooted");
        let pid = vmm.pid();
        vmm.kill();
        assert!(gone(pid));
        assert!(!base.join("firecracker/space-test-jail").exists(), "the jail is removed");
    });
}

#[test]
fn firecracker_engine_starts_a_microvm_jailed_and_not_and_waits_for_its_agent() {
    use space_engine::firecracker::{Firecracker, FirecrackerConfig};
    use space_engine::{Engine, SandboxSpec};
    let test = "firecracker_engine_starts_a_microvm_jailed_and_not_and_waits_for_its_agent";
    let Some(binary) = firecracker(test) else { return };
    let jailer = find_jailer(None, Some(&binary));
    if jailer.is_none() {
        skip(&format!("{test} (the jailed half): no jailer beside FIRECRACKER_BIN"));
    }
    let data = TestDataDir::new();
    let (kernel, initramfs) = guest();
    // A template version with a small ext4 root drive.
    let template = data.root().join("templates/tiny/1");
    std::fs::create_dir_all(template.join("rootfs/etc")).unwrap();
    std::fs::write(template.join("rootfs/etc/hostname"), "tiny\n").unwrap();
    space_host::template::make_ext4(&template.join("rootfs"), &template.join("rootfs.ext4"), 16).unwrap();
    for jailer in [jailer, None] {
        let jailed = jailer.is_some();
        let engine = Firecracker::new(FirecrackerConfig {
            firecracker: binary.clone(),
            kernel: kernel.clone(),
            initramfs: initramfs.clone(),
            jailer,
            jail_base: data.root().join("jail"),
            jail_uid: 65534,
        });
        let id = if jailed { "sbx_fcjail" } else { "sbx_fcplain" };
        let spec = SandboxSpec {
            id: id.into(),
            dir: data.data.sandbox_dir(id),
            template_rootfs: template.join("rootfs"),
            hostname: id.into(),
            vcpus: 1,
            memory_mib: 128,
            disk_mib: 16,
            env: Default::default(),
            workdir: None,
            user: None,
            engine: None,
        };
        runtime().block_on(async {
            let created = engine.create(&spec).await;
            if space_host::hardware_virtualization() {
                let started = created.expect("the microVM boots and its agent answers");
                assert!(started.agent.ping(std::time::Duration::from_secs(5)).await.is_ok());
            } else {
                // Everything up to InstanceStart worked (paths, owner, socket,
                // ids); only the guest cannot come up on kvm_pvm.
                let err = created.err().expect("no guest on this host").to_string();
                assert!(err.contains("did not dial home"), "jailed {jailed}: it failed before the agent: {err}");
            }
            engine.destroy(&spec).await.unwrap();
            let dashed = id.replace('_', "-");
            assert!(!spec.dir.exists(), "the sandbox dir is gone");
            assert!(!data.root().join("jail/firecracker").join(&dashed).exists(), "the jail is gone");
            assert_eq!(space_testkit::processes_mentioning(&dashed), 0, "no VMM is left");
        });
    }
}

#[test]
fn firecracker_engine_adopts_a_vmm_a_previous_server_left_running() {
    use space_engine::firecracker::{Firecracker, FirecrackerConfig};
    use space_engine::{Engine, LiveStatus, SandboxSpec};
    let Some(binary) = firecracker("firecracker_engine_adopts_a_vmm_a_previous_server_left_running") else { return };
    let data = TestDataDir::new();
    let (kernel, initramfs) = guest();
    let spec = SandboxSpec {
        id: "sbx_fcadopt".into(),
        dir: data.data.sandbox_dir("sbx_fcadopt"),
        template_rootfs: data.root().join("unused"),
        hostname: "sbx_fcadopt".into(),
        vcpus: 1,
        memory_mib: 128,
        disk_mib: 16,
        env: Default::default(),
        workdir: None,
        user: None,
        engine: None,
    };
    let config = FirecrackerConfig {
        firecracker: binary.clone(),
        kernel,
        initramfs,
        jailer: None,
        jail_base: data.root().join("jail"),
        jail_uid: 65534,
    };
    runtime().block_on(async {
        // What a previous server left: a started VMM and its pid file.
        let vmm = started_vmm(&binary, &spec.dir.join("vmm"), "sbx-fcadopt").await;
        let pid = vmm.pid();
        std::fs::write(spec.dir.join("vmm.pid"), pid.to_string()).unwrap();
        std::mem::forget(vmm); // the old server is gone without stopping it

        let engine = Firecracker::new(config);
        assert_eq!(engine.status(&spec), LiveStatus::Running, "the new engine finds the VMM");
        engine.pause(&spec).await.unwrap();
        assert_eq!(engine.status(&spec), LiveStatus::Paused);
        engine.resume(&spec).await.unwrap();
        engine.destroy(&spec).await.unwrap();
        assert!(gone(pid), "destroy stops the adopted VMM");
        assert!(!spec.dir.exists());
    });
}
