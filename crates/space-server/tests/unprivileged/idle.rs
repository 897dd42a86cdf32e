//! Idleness: the server pauses an idle sandbox (and resumes it for its next
//! request), tells the engine an idle one that stays running dozes (and
//! wakes it before it is used), and carries out lifecycle policies.

use serde_json::json;
use space_api::SandboxState;
use space_engine::fake::Call;
use space_engine::LiveStatus;

use crate::harness::{World, PATIENCE};

#[test]
fn an_idle_sandbox_is_paused_and_its_next_command_resumes_it() {
    let world = World::new();
    let node = world.start_with(|config| config.auto_pause_s = 1);
    let id = node.create();
    let paused = node.wait_state(&id, SandboxState::Paused);
    assert_eq!(paused["auto_paused"], true, "{paused}");
    assert_eq!(world.engine.status_of(&id), LiveStatus::Paused);
    let ran = node.exec(&id, &["echo", "woken"]);
    assert_eq!(ran["stdout"], "woken\n");
    assert_eq!(world.engine.count(Call::Resume, &id), 1);
}

#[test]
fn a_running_command_keeps_a_sandbox_from_being_paused() {
    let world = World::new();
    let node = world.start_with(|config| config.auto_pause_s = 1);
    let id = node.create();
    let command = node.start_command(&id, &["sleep", "3"]);
    // A loaded host may have paused it before the command (and resumed it
    // for the command): only pauses while the command runs count.
    let before = world.engine.count(Call::Pause, &id);
    let ended = node.wait_command(&id, &command);
    assert_eq!(ended["result"]["exit_code"], 0);
    assert_eq!(world.engine.count(Call::Pause, &id), before, "paused under a running command");
    // Idle once it ended: then it is paused.
    node.wait_state(&id, SandboxState::Paused);
}

#[test]
fn a_sandbox_that_opted_out_of_pauses_dozes_and_is_woken_before_use() {
    let world = World::new();
    let node = world.start_with(|config| config.auto_pause_s = 1);
    let id = node.create_with(json!({"lifecycle": {"auto_pause": false}}));
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.idle(&id)), "it never dozed");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
    let agent = world.engine.agent(&id).unwrap();
    assert_eq!(agent.execs_while_idle, 0, "a command ran while the engine thought it idle");
    assert_eq!(world.engine.count(Call::Pause, &id), 0);
    assert_eq!(node.state(&id), "running");
}

#[test]
fn with_idle_pauses_off_an_idle_sandbox_dozes_and_a_command_wakes_it() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.idle(&id)), "it never dozed");
    assert_eq!(node.exec(&id, &["echo", "up"])["stdout"], "up\n");
    assert_eq!(world.engine.agent(&id).unwrap().execs_while_idle, 0, "the command ran dozing");
    // Idle again after it: it dozes again.
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.idle(&id)), "it never dozed again");
}

#[test]
fn an_idle_policy_suspends_the_sandbox() {
    let world = World::new();
    let node = world.start();
    let id = node.create_with(json!({"lifecycle": {"idle_timeout_s": 1, "on_idle": "suspend"}}));
    node.wait_state(&id, SandboxState::Suspended);
    assert!(world.engine.snapshot_of(&id));
}

#[test]
fn an_idle_policy_deletes_the_sandbox() {
    let world = World::new();
    let node = world.start();
    let id = node.create_with(json!({"lifecycle": {"idle_timeout_s": 1, "on_idle": "delete"}}));
    node.wait_state(&id, SandboxState::Deleted);
    assert!(!world.engine.sandboxes().contains(&id));
}

#[test]
fn a_sandbox_past_its_lifetime_is_deleted_even_while_busy() {
    let world = World::new();
    let node = world.start();
    let id = node.create_with(json!({"lifecycle": {"max_lifetime_s": 1}}));
    let _command = node.start_command(&id, &["sleep", "60"]);
    node.wait_state(&id, SandboxState::Deleted);
}

#[test]
fn a_sandbox_paused_for_idleness_is_still_idle_by_its_own_policy() {
    let world = World::new();
    let node = world.start_with(|config| config.auto_pause_s = 1);
    // Its idle timeout comes well after the idle pause, even on a loaded host.
    let id = node.create_with(json!({"lifecycle": {"idle_timeout_s": 5, "on_idle": "suspend"}}));
    node.wait_state(&id, SandboxState::Suspended);
    let order: Vec<Call> = world
        .engine
        .calls()
        .into_iter()
        .filter(|(call, sandbox)| sandbox == &id && matches!(call, Call::Pause | Call::Resume | Call::Suspend))
        .map(|(call, _)| call)
        .collect();
    // Paused by the server, then thawed so its agent can let go, then suspended.
    assert_eq!(order, [Call::Pause, Call::Resume, Call::Suspend]);
}

#[test]
fn an_idle_pause_policy_pauses_without_marking_it_auto_paused() {
    let world = World::new();
    let node = world.start();
    let id = node.create_with(json!({"lifecycle": {"idle_timeout_s": 1, "on_idle": "pause"}}));
    let paused = node.wait_state(&id, SandboxState::Paused);
    assert_eq!(paused["auto_paused"], false, "{paused}");
    // Not resumed for a request: the client asked for it paused.
    node.refused("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["true"]})), 409, "invalid_state");
}
