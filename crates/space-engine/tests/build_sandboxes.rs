//! Build sandboxes on real runsc, through the helper's socket as a
//! confined server asks for them: a sandbox starts on a layer chain of the
//! cache (`StartFrom::Layer`), a command writes through its agent, and once
//! it is stopped its root is kept as the next chain (`SaveLayer`) holding
//! the step's work and nothing the platform put in (the agent, mount
//! points, its hostname, the egress CA); a sandbox on that chain sees the
//! work. The helper refuses to save a running sandbox, one started from
//! another chain or from none, and to start on a chain it does not have.
//! Needs root, runsc and the static agent, like the engine.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::io::{Seek, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::sh;
use space_engine::gvisor::{Gvisor, GvisorConfig, LocalConfig, LocalHost};
use space_engine::helper::{serve_engines, Engines, HelperHost};
use space_engine::host::EngineHost;
use space_engine::templates::{LocalTemplates, TemplateHost};
use space_engine::{Engine, SandboxSpec};
use space_privsep::layout::Layout;
use space_privsep::peer::HelperListener;
use space_privsep::proto::{ChainId, DiskMib, LayerKey, StepKey};
use space_testkit::{agent_bin, busybox_static, space_bin, TestDataDir};

const DEADLINE: Duration = Duration::from_secs(120);
/// The egress CA the build sandbox is told to trust (any PEM text: the
/// agent writes it, nothing checks it).
const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nU1BBQ0UgdGVzdCBDQQ==\n-----END CERTIFICATE-----\n";
/// What the chain's `/etc/hostname` says (the start and the agent write
/// others over it).
const CHAIN_HOSTNAME: &str = "made-by-the-image\n";

/// The helper, serving a gVisor host and the template host over a socket
/// in the test's data dir, on a runtime of its own; the engine and the
/// template requests go to it as a confined server's would.
struct Split {
    layout: Layout,
    templates: HelperHost,
    engine: Gvisor,
    engine_runtime: tokio::runtime::Runtime,
    helper_runtime: Option<tokio::runtime::Runtime>,
}

impl Split {
    fn start(data: &TestDataDir) -> Split {
        let layout = Layout::new(data.root());
        let state_dir = layout.runsc_state();
        let templates: Arc<dyn TemplateHost> =
            Arc::new(LocalTemplates::new(layout.clone(), agent_bin()).with_importer(space_bin()));
        let host: Arc<dyn EngineHost> = Arc::new(LocalHost::new(LocalConfig {
            runsc: "runsc".into(),
            agent_bin: agent_bin(),
            state_dir: state_dir.clone(),
            layout: layout.clone(),
        }));
        let helper_runtime = runtime();
        let socket = data.root().join("build-helper.sock");
        let me = nix::unistd::geteuid().as_raw();
        let listener = helper_runtime.block_on(async { HelperListener::bind(&socket, me) }).unwrap();
        helper_runtime.spawn(serve_engines(
            listener,
            Engines { gvisor: Some(host), firecracker: None },
            Some(templates),
        ));
        let config = GvisorConfig { runsc: "runsc".into(), agent_bin: agent_bin(), state_dir };
        Split {
            templates: HelperHost::with_patience(&socket, me, DEADLINE),
            engine: Gvisor::through_helper(config, &socket, me),
            engine_runtime: runtime(),
            helper_runtime: Some(helper_runtime),
            layout,
        }
    }

    fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.engine_runtime
            .block_on(async { tokio::time::timeout(DEADLINE, future).await.expect("within the deadline") })
    }

    /// A build sandbox's spec: its "template root" is the chain's root.
    fn spec(&self, tag: u8, chain: &ChainId) -> SandboxSpec {
        let id = format!("sbx_{:012x}{tag:08x}", std::process::id());
        let sandbox = space_privsep::proto::SandboxId::parse(&id).unwrap();
        SandboxSpec {
            dir: self.layout.sandbox_dir(&sandbox),
            template_rootfs: self.layout.layer_root(chain),
            hostname: id.replace('_', "-"),
            id,
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 512,
            trust_pem: Some(CA_PEM.into()),
            ..Default::default()
        }
    }

    fn sandbox_id(spec: &SandboxSpec) -> space_privsep::proto::SandboxId {
        space_privsep::proto::SandboxId::parse(&spec.id).unwrap()
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        if let Some(runtime) = self.helper_runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(10));
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn step(hex: char) -> StepKey {
    StepKey::parse(&hex.to_string().repeat(64)).unwrap()
}

/// A root to build on: a static busybox as `/bin/sh` and the applets the
/// steps use, and an `/etc/hostname` of its own; no `/proc`, `/dev`,
/// `/sys`, `/tmp` or `/usr`, as a minimal image has none.
fn busybox_root_tar() -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let dir = |builder: &mut tar::Builder<Vec<u8>>, path: &str| {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        builder.append_data(&mut header, path, std::io::empty()).unwrap();
    };
    dir(&mut builder, "bin");
    dir(&mut builder, "etc");
    let busybox = fs::read(busybox_static()).unwrap();
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(0o755);
    header.set_size(busybox.len() as u64);
    builder.append_data(&mut header, "bin/busybox", busybox.as_slice()).unwrap();
    for applet in ["sh", "mkdir", "cat", "ls"] {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_mode(0o777);
        header.set_size(0);
        builder.append_link(&mut header, format!("bin/{applet}"), "busybox").unwrap();
    }
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(0o644);
    header.set_size(CHAIN_HOSTNAME.len() as u64);
    builder.append_data(&mut header, "etc/hostname", CHAIN_HOSTNAME.as_bytes()).unwrap();
    builder.into_inner().unwrap()
}

fn file_of(bytes: &[u8]) -> fs::File {
    let mut name = [0u8; 8];
    getrandom::getrandom(&mut name).unwrap();
    let path = std::env::temp_dir()
        .join(format!("space-build-{}", name.iter().map(|b| format!("{b:02x}")).collect::<String>()));
    let mut file = fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
    fs::remove_file(&path).unwrap();
    file.write_all(bytes).unwrap();
    file.rewind().unwrap();
    file
}

/// Every path under `root`, relative to it (links not followed).
fn tree(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for entry in fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            out.insert(path.strip_prefix(root).unwrap().display().to_string());
            if fs::symlink_metadata(&path).unwrap().is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

#[test]
fn a_build_sandbox_on_a_chain_is_kept_as_the_next_chain_without_the_platforms_files() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::with_templates(&[]);
    let split = Split::start(&data);
    let templates: &dyn TemplateHost = &split.templates;
    let disk = DiskMib::new(256).unwrap();
    let apply = |key: StepKey, tar: &[u8]| {
        templates
            .apply_layer(None, &LayerKey::Step { key }, disk, file_of(tar), file_of(b""), &mut |_| {})
            .unwrap_or_else(|err| panic!("applying a layer: {err}"))
    };
    let base = apply(step('1'), &busybox_root_tar());
    let other = apply(step('2'), &busybox_root_tar());
    let base_root = split.layout.layer_root(&base.chain);

    // A build sandbox on the chain: the chain's files, the agent's work
    // (its CA trusted), and a step writing in its root and in /tmp.
    let spec = split.spec(1, &base.chain);
    let id = Split::sandbox_id(&spec);
    let agent = split.block_on(split.engine.create(&spec)).expect("a sandbox on the chain").agent;
    let seen = split.block_on(sh(&agent, "cat /usr/local/share/ca-certificates/space-egress-ca.crt /etc/hostname"));
    assert_eq!(seen, format!("{CA_PEM}{}\n", spec.hostname), "the platform's files are in the running root");
    split.block_on(sh(&agent, "mkdir -p /work && echo built > /work/out && echo kept > /tmp/step-tmp"));
    assert_eq!(fs::read_to_string(split.layout.sandbox_chain(&id)).unwrap(), base.chain.as_str());

    // Not while it runs.
    let err = templates.save_layer(&id, &base.chain, &step('a')).expect_err("a layer of a running sandbox");
    assert!(err.to_string().contains("is running"), "{err}");
    drop(agent);
    split.engine.stop(&spec).expect("stopping the build sandbox");
    // Only on the chain it started from; only of a sandbox started from one.
    let err = templates.save_layer(&id, &other.chain, &step('a')).expect_err("a layer on another chain");
    assert!(err.to_string().contains(&format!("started from layer chain {}", base.chain)), "{err}");
    let stranger = space_privsep::proto::SandboxId::parse("sbx_00000000000000000009").unwrap();
    let err = templates.save_layer(&stranger, &base.chain, &step('a')).expect_err("a layer of no build sandbox");
    assert!(err.to_string().contains("was not started from a layer chain"), "{err}");
    for key in ['a', 'b'] {
        let chain = ChainId::next(Some(&base.chain), &LayerKey::Step { key: step(key) });
        assert!(!templates.has_layer(&chain).unwrap(), "a refused save leaves no chain");
    }

    let saved = templates.save_layer(&id, &base.chain, &step('a')).expect("saving the step's layer");
    assert!(!saved.cached);
    assert_eq!(saved.chain, ChainId::next(Some(&base.chain), &LayerKey::Step { key: step('a') }));
    let again = templates.save_layer(&id, &base.chain, &step('a')).expect("saving it again");
    assert!(again.cached && again.chain == saved.chain);
    let saved_root = split.layout.layer_root(&saved.chain);
    // The chain below and the step's work, nothing else: no agent, no
    // mount point the chain lacked, no CA, the chain's own hostname.
    let mut expected = tree(&base_root);
    expected.extend(["work", "work/out", "tmp", "tmp/step-tmp"].map(String::from));
    assert_eq!(tree(&saved_root), expected);
    assert_eq!(fs::read_to_string(saved_root.join("etc/hostname")).unwrap(), CHAIN_HOSTNAME);
    assert!(fs::write(saved_root.join("work/out"), "changed").is_err(), "a chain is read-only");
    split.block_on(split.engine.destroy(&spec)).expect("destroy");
    assert!(!spec.dir.exists(), "the sandbox dir is gone");

    // The next step's sandbox starts on the saved chain and sees the work.
    let next = split.spec(2, &saved.chain);
    let agent = split.block_on(split.engine.create(&next)).expect("a sandbox on the saved chain").agent;
    assert_eq!(split.block_on(sh(&agent, "cat /work/out /tmp/step-tmp")), "built\nkept\n");
    drop(agent);
    split.block_on(split.engine.destroy(&next)).expect("destroy");

    // A chain the cache does not have starts nothing.
    let missing = ChainId::next(Some(&saved.chain), &LayerKey::Step { key: step('c') });
    let nowhere = split.spec(3, &missing);
    let err = split.block_on(split.engine.create(&nowhere)).err().expect("a start on a missing chain");
    assert!(err.to_string().contains("is not in the cache"), "{err}");
    assert!(!nowhere.dir.exists(), "a refused start leaves no sandbox dir");
    let ours = format!("sbx_{:012x}", std::process::id());
    assert_eq!(space_testkit::processes_mentioning(&ours), 0, "no runsc process is left");
}
