//! The gVisor engine on real runsc: create, exec, destroy.

use std::time::Duration;

mod common;

use common::{request, run, sh};
use space_engine::gvisor::{Gvisor, GvisorConfig};
use space_engine::{Engine, SandboxSpec};
use space_host::template::BASE_TEMPLATE;
use space_testkit::{agent_bin, TestDataDir};

fn spec(data: &TestDataDir, id: &str) -> SandboxSpec {
    let template = data.data.template(BASE_TEMPLATE).unwrap();
    SandboxSpec {
        id: id.into(),
        dir: data.data.sandbox_dir(id),
        template_rootfs: template.rootfs(),
        hostname: id.into(),
        vcpus: 1,
        memory_mib: 256,
        disk_mib: 1024,
        env: [("GREETING".to_string(), "hi".to_string())].into(),
        workdir: None,
        user: None,
        engine: None,
        trust_pem: None,
        volumes: Vec::new(),
    }
}

/// A sandbox id in the platform's one spelling (`sbx_` and 20 hex digits),
/// unique to this test process and `tag`, so no other run's processes count.
fn new_id(tag: u8) -> String {
    format!("sbx_{:012x}{tag:08x}", std::process::id())
}

fn engine(data: &TestDataDir) -> Gvisor {
    Gvisor::new(GvisorConfig {
        runsc: "runsc".into(),
        agent_bin: agent_bin(),
        state_dir: data.data.run_dir().join("runsc"),
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_boots_runs_commands_and_is_destroyed() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let engine = engine(&data);
    assert!(engine.availability().available, "{}", engine.availability().detail);
    let id = new_id(1);
    let spec = spec(&data, &id);
    let started = engine.create(&spec).await.expect("create");
    let agent = started.agent;
    assert_eq!(agent.hello().pid, 1, "the agent is PID 1");

    let (out, err, exited) = run(&agent, &["sh", "-c", "echo $GREETING $(hostname); echo oops >&2; exit 3"]).await;
    assert_eq!(String::from_utf8_lossy(&out), format!("hi {id}\n"));
    assert_eq!(String::from_utf8_lossy(&err), "oops\n");
    assert_eq!(exited.exit_code, Some(3));
    let (out, _, _) = run(&agent, &["uname", "-r"]).await;
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(String::from_utf8_lossy(&out).trim(), host_release.trim(), "the guest kernel is not the host's");

    let missing = agent.exec(&request(&["no-such-binary"])).await;
    assert!(
        matches!(missing, Err(space_engine::AgentError::ExecFailed(ref f)) if f.reason == space_proto::ExecFailure::NotFound),
        "a missing binary is a clear error"
    );

    engine.destroy(&spec).await.expect("destroy");
    assert!(!spec.dir.exists(), "the sandbox dir is gone");
    assert_eq!(space_testkit::processes_mentioning(&id), 0, "no runsc process is left");
    engine.destroy(&spec).await.expect("destroy is idempotent");
}

/// What a clone of a template snapshot goes through: its agent, quiesced
/// in the template, dials a host that welcomes it as another sandbox. It
/// must become that sandbox — id, hostname, env — not carry on as the one
/// it was saved as.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_welcomed_as_another_sandbox_takes_its_identity() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let engine = engine(&data);
    let spec = spec(&data, &new_id(2));
    let agent = engine.create(&spec).await.expect("create").agent;
    agent.quiesce(Duration::from_secs(10)).await.expect("quiesce");

    let socket =
        engine.redial(&spec).await.expect("listening again").accept_one().await.expect("the agent dials again");
    let mut clone = spec.clone();
    clone.id = "sbx_clone".into();
    clone.hostname = "sbx-clone".into();
    clone.env = [("ROLE".to_string(), "clone".to_string())].into();
    clone.workdir = Some("/tmp".into());
    let welcome = space_engine::welcome_for(&clone);
    let agent = space_engine::AgentConn::handshake(socket, welcome, Duration::from_secs(10)).await.expect("handshake");
    let seen = sh(&agent, "echo ${ROLE}/${GREETING}/${HOSTNAME}/$(hostname)/$(pwd)").await;
    assert_eq!(seen, "clone//sbx-clone/sbx-clone//tmp\n", "the new identity, nothing of the old");
    // Fresh entropy and env, as a clone is given after its welcome.
    let identity =
        space_engine::fresh_identity(&[("ROLE".to_string(), "handed-out".to_string())].into(), None).unwrap();
    agent.set_identity(&identity, Duration::from_secs(10)).await.expect("identity");
    assert_eq!(sh(&agent, "echo $ROLE").await, "handed-out\n");
    engine.destroy(&spec).await.expect("destroy");
}

/// An idle sandbox's tasks get coarse timers (systrap's poller wakes the
/// sentry ≈ 1000 times a second otherwise) and get their own back when it
/// is used again; commands run as usual either way.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_sandbox_gets_coarse_timers_and_its_own_back() {
    use space_engine::gvisor::{timer_slacks, IDLE_TIMER_SLACK_NS};
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let engine = engine(&data);
    let spec = spec(&data, &new_id(3));
    let agent = engine.create(&spec).await.expect("create").agent;
    let default = std::fs::read_to_string("/proc/self/timerslack_ns").unwrap().trim().parse::<u64>().unwrap();
    let before = timer_slacks(&spec.id).expect("its tasks");
    // The sentry's threads, a stub, the gofer: more than a handful.
    assert!(before.len() >= 5, "the sandbox's tasks: {before:?}");
    assert!(before.iter().all(|ns| *ns == default), "a new sandbox's timers are as usual: {before:?}");

    engine.set_idle(&spec, true);
    let idle = timer_slacks(&spec.id).unwrap();
    assert!(idle.len() >= before.len() && idle.iter().all(|ns| *ns == IDLE_TIMER_SLACK_NS), "idle: {idle:?}");
    assert_eq!(sh(&agent, "echo still answers").await, "still answers\n");

    engine.set_idle(&spec, false);
    // Tasks the command made were made by idle ones, which gave them
    // their slack as their default too: they are set, not reset.
    let woken = timer_slacks(&spec.id).unwrap();
    assert!(woken.iter().all(|ns| *ns == default), "woken: {woken:?}");
    engine.destroy(&spec).await.expect("destroy");
}
