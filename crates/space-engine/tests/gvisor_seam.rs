//! The gVisor engine's privileged work goes through its `EngineHost` and
//! nowhere else: a host that records each request (and binds a real agent
//! socket, dialed by a stand-in agent) shows which requests each engine
//! call makes, in which order, with the ids a path names. No root, no runsc.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use space_engine::gvisor::{Gvisor, GvisorConfig, IDLE_TIMER_SLACK_NS};
use space_engine::host::{EngineHost, Launched};
use space_engine::{Engine, EngineError, LiveStatus, SandboxSpec};
use space_privsep::layout::Layout;
use space_privsep::proto::{EngineState, ImageRef, Mount, PatienceMs, SandboxId, Shape, SlackNs, StartFrom};

const SBX: &str = "sbx_0123456789abcdef0123";
const FORK: &str = "sbx_99999999999999999999";

/// Every request the engine made, as `name id [detail]`.
#[derive(Default)]
struct Recording {
    requests: Mutex<Vec<String>>,
    scratch: PathBuf,
    sockets: AtomicUsize,
}

impl Recording {
    fn note(&self, request: String) {
        self.requests.lock().unwrap().push(request);
    }

    /// The requests made since the last call.
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.requests.lock().unwrap())
    }

    /// A listener an agent dials at once and hangs up on: enough for the
    /// engine to accept it (a handshake on it fails).
    fn dialed_listener(&self, sandbox: &SandboxId) -> UnixListener {
        let path = self.scratch.join(format!("{sandbox}.{}.sock", self.sockets.fetch_add(1, Ordering::Relaxed)));
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        drop(UnixStream::connect(&path).unwrap());
        listener
    }
}

fn shown(from: &StartFrom) -> String {
    match from {
        StartFrom::Template { template } => format!("template {}/{}", template.name, template.version.get()),
        StartFrom::Suspended {} => "suspended".into(),
        StartFrom::Image { source, image } => format!("image {source} {}", image_shown(image)),
        StartFrom::TemplateImage { template } => format!("template-image {}/{}", template.name, template.version.get()),
        StartFrom::Clone { template } => format!("clone {}/{}", template.name, template.version.get()),
        StartFrom::Layer { chain } => format!("layer {chain}"),
    }
}

fn image_shown(image: &ImageRef) -> String {
    match image {
        ImageRef::Fork { operation } => format!("fork {operation}"),
        ImageRef::Checkpoint { name } => format!("checkpoint {name}"),
        ImageRef::Template { template } => format!("template {}/{}", template.name, template.version.get()),
    }
}

impl EngineHost for Recording {
    fn start(
        &self,
        sandbox: &SandboxId,
        from: &StartFrom,
        shape: Shape,
        mounts: &[Mount],
    ) -> Result<Launched, EngineError> {
        let listener = self.dialed_listener(sandbox);
        let (memory, vcpus, disk) = (shape.memory_mib.get(), shape.vcpus.get(), shape.disk_mib.get());
        let mounts: String = mounts
            .iter()
            .map(|m| format!(" {}@{}{}", m.volume, m.path, if m.read_only { ":ro" } else { "" }))
            .collect();
        self.note(format!("start {sandbox} {} {memory}/{vcpus}/{disk}{mounts}", shown(from)));
        Ok(Launched { listener, pid: 1, finished: Box::new(|| Ok(())), steps: Vec::new() })
    }
    fn pause(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.note(format!("pause {sandbox}"));
        Ok(())
    }
    fn resume(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.note(format!("resume {sandbox}"));
        Ok(())
    }
    fn freeze(&self, sandbox: &SandboxId, frozen: bool) -> Result<(), EngineError> {
        self.note(format!("freeze {sandbox} {frozen}"));
        Ok(())
    }
    fn set_timer_slack(&self, sandbox: &SandboxId, slack: Option<SlackNs>) -> Result<usize, EngineError> {
        self.note(format!("set_timer_slack {sandbox} {:?}", slack.map(SlackNs::get)));
        Ok(1)
    }
    fn suspend(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.note(format!("suspend {sandbox}"));
        Ok(())
    }
    fn save_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<Duration, EngineError> {
        self.note(format!("save_image {sandbox} {}", image_shown(image)));
        Ok(Duration::from_millis(1))
    }
    fn drop_snapshot(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.note(format!("drop_snapshot {sandbox}"));
        Ok(())
    }
    fn stop(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.note(format!("stop {sandbox}"));
        Ok(())
    }
    fn stop_strays(&self, sandbox: &SandboxId) {
        self.note(format!("stop_strays {sandbox}"));
    }
    fn settle_orphans(&self, sandboxes: &[SandboxId], patience: PatienceMs) {
        self.note(format!("settle_orphans {} {}", sandboxes.len(), patience.get()));
    }
    fn destroy(&self, sandbox: &SandboxId) -> Result<(), EngineError> {
        self.note(format!("destroy {sandbox}"));
        Ok(())
    }
    fn state(&self, sandbox: &SandboxId) -> EngineState {
        self.note(format!("state {sandbox}"));
        EngineState::Paused
    }
    fn states(&self, sandboxes: &[SandboxId]) -> Vec<EngineState> {
        self.note(format!("states {}", sandboxes.len()));
        sandboxes.iter().map(|_| EngineState::Running).collect()
    }
    fn listen_agent(&self, sandbox: &SandboxId) -> Result<UnixListener, EngineError> {
        let listener = self.dialed_listener(sandbox);
        self.note(format!("listen_agent {sandbox}"));
        Ok(listener)
    }
    fn close_agent(&self, sandbox: &SandboxId) {
        self.note(format!("close_agent {sandbox}"));
    }
    fn drop_image(&self, sandbox: &SandboxId, image: &ImageRef) -> Result<(), EngineError> {
        self.note(format!("drop_image {sandbox} {image:?}"));
        Ok(())
    }

    fn availability(&self) -> (bool, String) {
        self.note("availability".to_string());
        (true, "recorded".into())
    }

    fn engine_log(&self, sandbox: &SandboxId) -> String {
        self.note(format!("engine_log {sandbox}"));
        String::new()
    }
}

struct Setup {
    data: PathBuf,
    host: Arc<Recording>,
    engine: Gvisor,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn setup(name: &str) -> Setup {
    let data = std::env::temp_dir().join(format!("space-seam-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let scratch = data.join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let host = Arc::new(Recording { scratch, ..Default::default() });
    let config = GvisorConfig {
        runsc: "runsc".into(),
        agent_bin: "/nonexistent/space-agent".into(),
        state_dir: data.join("run/runsc"),
    };
    let engine = Gvisor::with_host(config, Layout::new(&data), host.clone());
    Setup { data, host, engine }
}

fn spec(data: &Path, id: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        dir: data.join("sandboxes").join(id),
        template_rootfs: data.join("templates/base/3/rootfs"),
        hostname: id.replace('_', "-"),
        vcpus: 2,
        memory_mib: 512,
        disk_mib: 2048,
        ..Default::default()
    }
}

/// Writes the file by which the engine knows a checkpoint (memory) is whole.
fn whole(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("checkpoint.img"), b"").unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn each_engine_call_makes_its_requests_in_order() {
    let Setup { data, host, engine } = &setup("order");
    let spec = spec(data, SBX);

    // A create whose agent hangs up: started, its socket closed once the
    // agent is in, and everything cleared after the failed handshake.
    assert!(engine.create(&spec).await.is_err(), "the stand-in agent says no hello");
    assert_eq!(
        host.take(),
        [format!("start {SBX} template base/3 512/2/2048"), format!("close_agent {SBX}"), format!("destroy {SBX}")]
    );

    engine.pause(&spec).await.unwrap();
    assert_eq!(host.take(), [format!("pause {SBX}"), format!("freeze {SBX} true")]);
    engine.resume(&spec).await.unwrap();
    assert_eq!(host.take(), [format!("freeze {SBX} false"), format!("resume {SBX}")]);

    engine.set_idle(&spec, true);
    engine.set_idle(&spec, false);
    assert_eq!(
        host.take(),
        [format!("set_timer_slack {SBX} Some({IDLE_TIMER_SLACK_NS})"), format!("set_timer_slack {SBX} None")]
    );

    engine.suspend(&spec).await.unwrap();
    assert_eq!(host.take(), [format!("suspend {SBX}")]);
    // A restore asks for nothing until the snapshot is whole, and drops
    // the snapshot only once the agent is in.
    assert!(engine.restore(&spec).await.is_err());
    assert!(host.take().is_empty());
    whole(&spec.dir.join("snapshot"));
    engine.restore(&spec).await.unwrap();
    assert_eq!(
        host.take(),
        [format!("start {SBX} suspended 512/2/2048"), format!("close_agent {SBX}"), format!("drop_snapshot {SBX}")]
    );

    let listener = engine.redial(&spec).await.unwrap();
    assert_eq!(host.take(), [format!("listen_agent {SBX}")]);
    listener.accept_one().await.unwrap();
    assert_eq!(host.take(), [format!("close_agent {SBX}")], "a listener dropped closes the socket");

    assert_eq!(engine.status(&spec), LiveStatus::Paused);
    assert_eq!(engine.statuses(&[spec.clone(), spec.clone()]), [LiveStatus::Running, LiveStatus::Running]);
    assert_eq!(host.take(), [format!("state {SBX}"), "states 2".to_string()]);

    engine.stop_strays(&spec);
    engine.stop(&spec).unwrap();
    engine.settle_orphans(&[SBX.to_string(), "not-an-id".to_string()], Duration::from_secs(3));
    engine.destroy(&spec).await.unwrap();
    assert_eq!(
        host.take(),
        [format!("stop_strays {SBX}"), format!("stop {SBX}"), "settle_orphans 1 3000".into(), format!("destroy {SBX}")]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn images_are_named_by_id_whatever_path_the_platform_hands_in() {
    let Setup { data, host, engine } = &setup("images");
    let (source, fork) = (spec(data, SBX), spec(data, FORK));
    let operation = "op_00112233445566778899";

    // A fork: the source saves an image under itself, the fork starts from it.
    let image = source.dir.join("images").join(operation);
    engine.save_image(&source, &image).await.unwrap();
    assert_eq!(host.take(), [format!("save_image {SBX} fork {operation}")]);
    assert!(engine.start_from_image(&fork, &image).await.is_err(), "no memory saved yet");
    assert!(host.take().is_empty());
    whole(&image.join("memory"));
    engine.start_from_image(&fork, &image).await.unwrap();
    assert_eq!(
        host.take(),
        [format!("start {FORK} image {SBX} fork {operation} 512/2/2048"), format!("close_agent {FORK}")]
    );

    // A checkpoint, and a rewind to it.
    let checkpoint = source.dir.join("checkpoints/before");
    engine.save_image(&source, &checkpoint).await.unwrap();
    whole(&checkpoint.join("memory"));
    engine.start_from_image(&source, &checkpoint).await.unwrap();
    assert_eq!(
        host.take(),
        [
            format!("save_image {SBX} checkpoint before"),
            format!("start {SBX} image {SBX} checkpoint before 512/2/2048"),
            format!("close_agent {SBX}")
        ]
    );

    // A snapshot template: saved into its build dir, started from once published.
    engine.save_image(&source, &data.join("templates/snap/.4.partial")).await.unwrap();
    let published = data.join("templates/snap/4");
    whole(&published.join("memory"));
    engine.start_from_image(&fork, &published).await.unwrap();
    assert_eq!(
        host.take(),
        [
            format!("save_image {SBX} template snap/4"),
            format!("start {FORK} template-image snap/4 512/2/2048"),
            format!("close_agent {FORK}")
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn nothing_is_asked_for_a_sandbox_or_image_the_layout_does_not_place() {
    let Setup { data, host, engine } = &setup("refused");
    let mut elsewhere = spec(data, SBX);
    elsewhere.dir = PathBuf::from("/var/lib/other-space/sandboxes").join(SBX);
    assert!(engine.create(&elsewhere).await.is_err());
    assert!(engine.destroy(&elsewhere).await.is_err());
    assert!(engine.stop(&elsewhere).is_err());
    engine.stop_strays(&elsewhere);
    assert_eq!(engine.status(&elsewhere), LiveStatus::Gone);

    let mut not_canonical = spec(data, "sbx_enginetest");
    not_canonical.dir = data.join("sandboxes/sbx_enginetest");
    assert!(engine.pause(&not_canonical).await.is_err());

    assert_eq!(host.take(), Vec::<String>::new(), "not one request");

    // A sandbox placed right but starting from a root elsewhere, or past
    // the bounds: no start; a failed create clears its own sandbox, as
    // every failed create does.
    let mut foreign_root = spec(data, SBX);
    foreign_root.template_rootfs = PathBuf::from("/");
    assert!(engine.create(&foreign_root).await.is_err());
    let mut huge = spec(data, SBX);
    huge.memory_mib = 1 << 30;
    assert!(engine.create(&huge).await.is_err());
    assert_eq!(host.take(), [format!("destroy {SBX}"), format!("destroy {SBX}")]);

    let source = spec(data, SBX);
    for image in [
        PathBuf::from("/tmp/image"),
        source.dir.join("images/op_00112233445566778899/../../../etc"),
        source.dir.join("rootfs"),
        PathBuf::from("/var/lib/other-space/sandboxes").join(SBX).join("images/op_00112233445566778899"),
    ] {
        assert!(engine.save_image(&source, &image).await.is_err(), "{image:?}");
        assert!(engine.start_from_image(&source, &image).await.is_err(), "{image:?}");
    }
    assert_eq!(host.take(), Vec::<String>::new(), "not one request");
}

/// Every start of a sandbox that mounts volumes names them to the host —
/// a create, a restore from its suspend, a fork's and a checkpoint's — and
/// mounts the platform could not have checked ask for nothing.
#[tokio::test(flavor = "multi_thread")]
async fn every_start_carries_the_specs_volumes() {
    let Setup { data, host, engine } = &setup("volumes");
    let with_volumes = |id: &str| SandboxSpec {
        volumes: vec![
            space_engine::VolumeMountSpec {
                volume: "vol_0123456789abcdef0123".into(),
                path: "/workspace".into(),
                read_only: false,
            },
            space_engine::VolumeMountSpec {
                volume: "vol_fedcba9876543210fedc".into(),
                path: "/srv/shared".into(),
                read_only: true,
            },
        ],
        ..spec(data, id)
    };
    let (source, fork) = (with_volumes(SBX), with_volumes(FORK));
    let mounts = " vol_0123456789abcdef0123@/workspace vol_fedcba9876543210fedc@/srv/shared:ro";

    assert!(engine.create(&source).await.is_err(), "the stand-in agent says no hello");
    assert_eq!(host.take()[0], format!("start {SBX} template base/3 512/2/2048{mounts}"));
    whole(&source.dir.join("snapshot"));
    engine.restore(&source).await.unwrap();
    assert_eq!(host.take()[0], format!("start {SBX} suspended 512/2/2048{mounts}"));
    let image = source.dir.join("images/op_00112233445566778899");
    whole(&image.join("memory"));
    engine.start_from_image(&fork, &image).await.unwrap();
    assert_eq!(host.take()[0], format!("start {FORK} image {SBX} fork op_00112233445566778899 512/2/2048{mounts}"));
    let checkpoint = source.dir.join("checkpoints/before");
    whole(&checkpoint.join("memory"));
    engine.start_from_image(&source, &checkpoint).await.unwrap();
    assert_eq!(host.take()[0], format!("start {SBX} image {SBX} checkpoint before 512/2/2048{mounts}"));

    // A restore with a whole snapshot, so that only its mounts can refuse it.
    whole(&fork.dir.join("snapshot"));
    for (volume, path) in [
        ("vol_0123456789abcdef0123", "/"),
        ("vol_0123456789abcdef0123", "/proc"),
        ("vol_0123456789abcdef0123", "relative"),
        ("vol_0123456789abcdef0123", "/a/../b"),
        ("vol_../../etc", "/workspace"),
    ] {
        let mut bad = spec(data, FORK);
        bad.volumes = vec![space_engine::VolumeMountSpec { volume: volume.into(), path: path.into(), read_only: true }];
        let err = engine.restore(&bad).await.err().unwrap();
        assert!(!err.to_string().contains("snapshot"), "{volume} at {path}: {err}");
    }
    let mut twice = with_volumes(FORK);
    twice.volumes[1].path = "/workspace/sub".into();
    let err = engine.restore(&twice).await.err().unwrap();
    assert!(err.to_string().contains("under"), "{err}");
    assert!(host.take().iter().all(|request| !request.starts_with("start")), "no start was asked for");
}
