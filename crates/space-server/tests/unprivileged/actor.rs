//! The per-sandbox actor: one job at a time, every transition persisted,
//! engine and agent failures turned into a failed sandbox or operation.

use serde_json::json;
use space_api::SandboxState;
use space_engine::fake::{AgentScript, Call, Fault};
use space_engine::LiveStatus;

use crate::harness::{World, PATIENCE};

#[test]
fn a_created_sandbox_runs_and_its_agent_got_its_identity() {
    let world = World::new();
    let node = world.start();
    let id = node.create_with(json!({"env": {"GREETING": "hello"}}));
    assert_eq!(node.state(&id), "running");
    assert_eq!(world.engine.status_of(&id), LiveStatus::Running);
    let agent = world.engine.agent(&id).expect("its agent");
    let welcome = agent.welcome.expect("a welcome");
    assert_eq!(welcome.sandbox_id, id);
    assert_eq!(agent.env.get("GREETING").map(String::as_str), Some("hello"));
    let ran = node.exec(&id, &["env", "GREETING"]);
    assert_eq!(ran["stdout"], "hello\n", "{ran}");
    assert_eq!(ran["result"]["exit_code"], 0);
}

#[test]
fn pause_and_resume_freeze_and_thaw_the_sandbox() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.act(&id, "pause")["state"], "succeeded");
    assert_eq!(node.state(&id), "paused");
    assert_eq!(world.engine.status_of(&id), LiveStatus::Paused);
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    assert_eq!(node.state(&id), "running");
    assert_eq!(world.engine.status_of(&id), LiveStatus::Running);
    assert_eq!(node.exec(&id, &["echo", "awake"])["stdout"], "awake\n");
}

#[test]
fn suspend_and_resume_keep_the_agent_and_its_files() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    let written = node.call("PUT", &format!("/v1/sandboxes/{id}/files?path=/root/note"), Some(json!("kept")));
    assert!(written.0 < 300, "{written:?}");
    assert_eq!(node.act(&id, "suspend")["state"], "succeeded");
    assert_eq!(node.state(&id), "suspended");
    assert!(world.engine.snapshot_of(&id));
    assert_eq!(world.engine.status_of(&id), LiveStatus::Gone);
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    assert_eq!(node.state(&id), "running");
    let agent = world.engine.agent(&id).unwrap();
    // The same agent came back on the restored socket, proving its key.
    assert_eq!((agent.handshakes, agent.redials), (2, 1));
    assert!(agent.files.contains_key("/root/note"), "{:?}", agent.files.keys());
    assert_eq!(node.exec(&id, &["echo", "back"])["stdout"], "back\n");
}

#[test]
fn a_command_running_across_a_suspend_ends_after_the_resume() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    let command = node.start_command(&id, &["sleep", "1"]);
    assert_eq!(node.act(&id, "suspend")["state"], "succeeded");
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    let ended = node.wait_command(&id, &command);
    assert_eq!(ended["result"]["exit_code"], 0, "{ended}");
}

#[test]
fn delete_destroys_the_sandbox_and_a_second_delete_succeeds_at_once() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert!(world.sandbox_dir(&id).is_dir());
    assert_eq!(node.delete(&id)["state"], "succeeded");
    assert_eq!(node.state(&id), "deleted");
    assert_eq!(world.engine.count(Call::Destroy, &id), 1);
    assert!(!world.engine.sandboxes().contains(&id));
    assert!(!world.sandbox_dir(&id).exists());
    let again = node.delete(&id);
    assert_eq!(again["state"], "succeeded");
    assert_eq!(again["progress"]["step"], "already deleted");
    assert_eq!(world.engine.count(Call::Destroy, &id), 1);
}

#[test]
fn an_engine_failure_at_create_fails_the_sandbox_and_frees_its_memory() {
    let world = World::new();
    let node = world.start();
    world.engine.fault(Call::Create, None, Fault::Fail);
    let (id, operation) = node.create_started(json!({"template": "base"}));
    let done = node.wait_op(&operation);
    assert_eq!(done["state"], "failed");
    assert_eq!(done["error"]["code"], "engine_failed", "{done}");
    let sandbox = node.sandbox(&id);
    assert_eq!(sandbox["state"], "failed");
    assert!(sandbox["failure_reason"].as_str().unwrap().contains("isolation engine"), "{sandbox}");
    assert_eq!(node.platform.reserved_mib(), 0, "a failed sandbox holds no memory");
}

#[test]
fn a_refused_handshake_fails_the_create_and_leaves_nothing() {
    let world = World::new();
    let node = world.start();
    world.engine.script_agents(AgentScript { refuse_handshake: true, ..Default::default() });
    let (id, operation) = node.create_started(json!({"template": "base"}));
    let done = node.wait_op(&operation);
    assert_eq!(done["state"], "failed", "{done}");
    let sandbox = node.sandbox(&id);
    assert!(sandbox["failure_reason"].as_str().unwrap().contains("agent"), "{sandbox}");
    assert!(!world.engine.sandboxes().contains(&id), "the engine keeps nothing of it");
}

#[test]
fn a_slow_agent_is_waited_for() {
    let world = World::new();
    let node = world.start();
    let slow = std::time::Duration::from_millis(300);
    world.engine.script_agents(AgentScript { delay: slow, ..Default::default() });
    let id = node.create();
    assert_eq!(node.act(&id, "suspend")["state"], "succeeded");
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    assert_eq!(node.state(&id), "running");
}

#[test]
fn a_crash_in_the_middle_of_a_suspend_fails_the_sandbox() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    world.engine.fault(Call::Suspend, Some(&id), Fault::Die);
    let done = node.act(&id, "suspend");
    assert_eq!(done["state"], "failed");
    assert!(done["error"]["message"].as_str().unwrap().contains("writing the snapshot"), "{done}");
    let sandbox = node.sandbox(&id);
    assert_eq!(sandbox["state"], "failed");
    assert!(!world.engine.snapshot_of(&id));
    // What was left of it was stopped.
    assert!(world.engine.count(Call::Stop, &id) >= 1);
    // A failed sandbox can still be deleted.
    assert_eq!(node.delete(&id)["state"], "succeeded");
}

#[test]
fn a_failed_restore_fails_the_sandbox() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.act(&id, "suspend")["state"], "succeeded");
    world.engine.fault(Call::Restore, Some(&id), Fault::Fail);
    let done = node.act(&id, "resume");
    assert_eq!(done["state"], "failed");
    assert_eq!(node.state(&id), "failed");
    assert!(node.sandbox(&id)["failure_reason"].as_str().unwrap().contains("resuming from the snapshot"));
}

#[test]
fn a_failed_pause_fails_the_operation_and_leaves_the_sandbox_running() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    world.engine.fault(Call::Pause, Some(&id), Fault::Fail);
    let done = node.act(&id, "pause");
    assert_eq!(done["state"], "failed");
    assert_eq!(done["error"]["code"], "engine_failed");
    assert_eq!(node.state(&id), "running");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
}

#[test]
fn a_sandbox_that_dies_is_failed_with_the_reason() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    world.engine.kill(&id);
    let sandbox = node.wait_state(&id, SandboxState::Failed);
    assert!(sandbox["failure_reason"].as_str().unwrap().contains("stopped unexpectedly"), "{sandbox}");
    node.refused("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["true"]})), 409, "invalid_state");
}

#[test]
fn requests_invalid_in_the_state_are_refused_before_any_work() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    node.refused("POST", &format!("/v1/sandboxes/{id}/resume"), None, 409, "invalid_state");
    assert_eq!(node.act(&id, "pause")["state"], "succeeded");
    node.refused("POST", &format!("/v1/sandboxes/{id}/pause"), None, 409, "invalid_state");
    assert_eq!(world.engine.count(Call::Resume, &id), 0);
    assert_eq!(world.engine.count(Call::Pause, &id), 1);
}

#[test]
fn jobs_queued_together_run_one_at_a_time_in_order() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    // While the pause is under way, a suspend and a delete are accepted
    // (each valid in the state the sandbox is in) and wait their turn.
    world.engine.fault(Call::Pause, Some(&id), Fault::Held);
    let pause = node.request(&id, "pause");
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.count(Call::Pause, &id) == 1));
    let suspend = node.request(&id, "suspend");
    let delete =
        node.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)["operation"]["id"].as_str().unwrap().to_string();
    world.engine.release(Call::Pause, &id);
    for operation in [&pause, &suspend, &delete] {
        assert_eq!(node.wait_op(operation)["state"], "succeeded");
    }
    let order: Vec<Call> = world
        .engine
        .calls()
        .into_iter()
        .filter(|(call, sandbox)| sandbox == &id && *call != Call::Stop)
        .map(|(call, _)| call)
        .collect();
    // The suspend thaws the paused sandbox so its agent can let go.
    assert_eq!(order, [Call::Create, Call::Pause, Call::Resume, Call::Suspend, Call::Destroy]);
    assert_eq!(node.state(&id), "deleted");
}

#[test]
fn two_resumes_of_one_pause_both_succeed_and_thaw_once() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.act(&id, "pause")["state"], "succeeded");
    world.engine.fault(Call::Resume, Some(&id), Fault::Held);
    let first = node.request(&id, "resume");
    let second = node.request(&id, "resume");
    world.engine.release(Call::Resume, &id);
    assert_eq!(node.wait_op(&first)["state"], "succeeded");
    assert_eq!(node.wait_op(&second)["state"], "succeeded", "the second finds it where it leads");
    assert_eq!(world.engine.count(Call::Resume, &id), 1);
}

#[test]
fn a_delete_behind_a_slow_create_waits_for_it() {
    let world = World::new();
    let node = world.start();
    world.engine.script_agents(AgentScript { delay: std::time::Duration::from_millis(200), ..Default::default() });
    let (id, create) = node.create_started(json!({"template": "base"}));
    let deleted = node.ok("DELETE", &format!("/v1/sandboxes/{id}"), None);
    let delete = deleted["operation"]["id"].as_str().unwrap().to_string();
    assert_eq!(node.wait_op(&create)["state"], "succeeded");
    assert_eq!(node.wait_op(&delete)["state"], "succeeded");
    assert_eq!(node.state(&id), "deleted");
    let order: Vec<Call> =
        world.engine.calls().into_iter().filter(|(_, sandbox)| sandbox == &id).map(|(call, _)| call).collect();
    assert_eq!(order, [Call::Create, Call::Destroy]);
}

#[test]
fn a_fork_starts_copies_that_run_as_sandboxes_of_their_own() {
    let world = World::new();
    let node = world.start();
    let id = node.create_with(json!({"env": {"WHO": "source"}}));
    let answer = node.ok("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({"count": 2})));
    let done = node.wait_op(answer["operation"]["id"].as_str().unwrap());
    assert_eq!(done["state"], "succeeded", "{done}");
    let forks: Vec<String> = done["forks"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().into()).collect();
    assert_eq!(forks.len(), 2);
    for fork in &forks {
        assert_eq!(node.state(fork), "running");
        let agent = world.engine.agent(fork).unwrap();
        assert_eq!(agent.welcome.as_ref().unwrap().sandbox_id, *fork, "welcomed as itself");
        assert_eq!(agent.identities, 1, "fresh entropy");
        assert_eq!(node.exec(fork, &["hostname"])["result"]["exit_code"], 0);
    }
    assert_eq!(node.state(&id), "running");
    assert_eq!(node.exec(&id, &["echo", "still"])["stdout"], "still\n");
}

#[test]
fn a_fork_whose_copies_cannot_start_fails_them_and_not_its_source() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    world.engine.fault(Call::StartFromImage, None, Fault::Fail);
    let answer = node.ok("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({"count": 1})));
    let done = node.wait_op(answer["operation"]["id"].as_str().unwrap());
    assert_eq!(done["state"], "failed", "{done}");
    let fork = done["forks"][0].as_str().unwrap();
    assert_eq!(node.state(fork), "failed");
    assert_eq!(node.state(&id), "running");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
}
