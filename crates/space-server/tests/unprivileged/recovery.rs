//! A server killed and started again over the same data dir: what was in
//! flight is settled from what the engine shows, live sandboxes are taken
//! back (their agents redial with their key), accepted operations are
//! carried out, and leftovers are swept.

use serde_json::json;
use space_api::SandboxState;
use space_engine::fake::{AgentScript, Call, Fault};
use space_engine::LiveStatus;

use crate::harness::{World, PATIENCE};

#[test]
fn a_running_sandbox_is_taken_back_after_a_restart() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    node.kill();
    let node = world.start();
    // Requests wait for its re-adoption.
    assert_eq!(node.exec(&id, &["echo", "again"])["stdout"], "again\n");
    let agent = world.engine.agent(&id).unwrap();
    assert_eq!(agent.redials, 1, "its agent redialed, proving its key");
    assert_eq!(node.state(&id), "running");
}

#[test]
fn a_command_running_at_a_restart_is_followed_to_its_end() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    let command = node.start_command(&id, &["sleep", "1.5"]);
    node.kill();
    let node = world.start();
    let ended = node.wait_command(&id, &command);
    assert_eq!(ended["result"]["exit_code"], 0, "its end came through the taken-back stream: {ended}");
}

#[test]
fn a_paused_sandbox_stays_frozen_until_it_is_next_used() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.act(&id, "pause")["state"], "succeeded");
    node.kill();
    let node = world.start();
    assert!(node.block_on(node.platform.until_reconciled(&id, PATIENCE)));
    assert_eq!(node.state(&id), "paused");
    assert_eq!(world.engine.count(Call::Resume, &id), 0, "not thawed at the restart");
    assert_eq!(world.engine.agent(&id).unwrap().redials, 0);
    // The resume takes its agent back, thawing it for good.
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    assert_eq!(world.engine.status_of(&id), LiveStatus::Running);
    assert_eq!(world.engine.agent(&id).unwrap().redials, 1);
    assert_eq!(node.exec(&id, &["echo", "thawed"])["stdout"], "thawed\n");
}

#[test]
fn a_frozen_sandbox_taken_back_for_a_suspend_is_suspended() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.act(&id, "pause")["state"], "succeeded");
    node.kill();
    let node = world.start();
    // Thawed for the handshake, frozen again, then suspended.
    assert_eq!(node.act(&id, "suspend")["state"], "succeeded");
    assert!(world.engine.snapshot_of(&id));
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
}

#[test]
fn a_sandbox_gone_while_the_server_was_down_is_failed_with_its_commands_ended() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    let command = node.start_command(&id, &["sleep", "60"]);
    node.kill();
    world.engine.kill(&id);
    let node = world.start();
    let sandbox = node.wait_state(&id, SandboxState::Failed);
    assert!(sandbox["failure_reason"].as_str().unwrap().contains("could not re-adopt"), "{sandbox}");
    let lost = node.wait_command(&id, &command);
    assert!(lost["result"].is_object(), "the command has a result saying it was lost: {lost}");
}

#[test]
fn the_record_follows_a_pause_the_engine_did_before_the_restart() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    node.kill();
    world.engine.set_frozen(&id, true);
    let node = world.start();
    assert!(node.block_on(node.platform.until_reconciled(&id, PATIENCE)));
    assert_eq!(node.state(&id), "paused");
}

#[test]
fn the_record_follows_a_resume_the_engine_did_before_the_restart() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.act(&id, "pause")["state"], "succeeded");
    node.kill();
    world.engine.set_frozen(&id, false);
    let node = world.start();
    node.wait_state(&id, SandboxState::Running);
    assert_eq!(node.exec(&id, &["echo", "running"])["stdout"], "running\n");
}

#[test]
fn a_suspend_whose_snapshot_was_written_before_the_restart_is_done() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    world.engine.fault(Call::Suspend, Some(&id), Fault::HangAfter);
    let operation = node.request(&id, "suspend");
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.snapshot_of(&id)));
    assert_eq!(node.state(&id), "suspending");
    node.kill();
    let node = world.start();
    assert_eq!(node.wait_op(&operation)["state"], "succeeded");
    assert_eq!(node.state(&id), "suspended");
    assert_eq!(world.engine.count(Call::Suspend, &id), 1, "not carried out twice");
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
}

#[test]
fn a_suspend_cut_short_by_a_restart_is_rolled_back_and_carried_out_again() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    world.engine.fault(Call::Suspend, Some(&id), Fault::Hang);
    let operation = node.request(&id, "suspend");
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.count(Call::Suspend, &id) == 1));
    node.kill();
    let node = world.start();
    assert_eq!(node.wait_op(&operation)["state"], "succeeded");
    assert_eq!(node.state(&id), "suspended");
    assert_eq!(world.engine.count(Call::Suspend, &id), 2);
    assert_eq!(node.act(&id, "resume")["state"], "succeeded");
    assert_eq!(node.exec(&id, &["echo", "whole"])["stdout"], "whole\n");
}

#[test]
fn a_resume_cut_short_by_a_restart_is_rolled_back_and_carried_out_again() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.act(&id, "suspend")["state"], "succeeded");
    world.engine.fault(Call::Restore, Some(&id), Fault::Hang);
    let operation = node.request(&id, "resume");
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.count(Call::Restore, &id) == 1));
    node.kill();
    let node = world.start();
    assert_eq!(node.wait_op(&operation)["state"], "succeeded");
    assert_eq!(node.state(&id), "running");
    assert_eq!(node.exec(&id, &["echo", "restored"])["stdout"], "restored\n");
}

#[test]
fn a_create_cut_short_by_a_restart_starts_over() {
    let world = World::new();
    let node = world.start();
    world.engine.fault(Call::Create, None, Fault::HangAfter);
    let (id, operation) = node.create_started(json!({"template": "base"}));
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.count(Call::Create, &id) == 1));
    node.kill();
    let node = world.start();
    assert_eq!(node.wait_op(&operation)["state"], "succeeded");
    assert_eq!(node.state(&id), "running");
    assert!(world.engine.count(Call::Destroy, &id) >= 1, "the first attempt's leftovers were cleared");
    assert_eq!(world.engine.count(Call::Create, &id), 2);
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
}

#[test]
fn a_delete_cut_short_by_a_restart_is_finished() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    world.engine.fault(Call::Destroy, Some(&id), Fault::Hang);
    let answer = node.ok("DELETE", &format!("/v1/sandboxes/{id}"), None);
    let operation = answer["operation"]["id"].as_str().unwrap().to_string();
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.count(Call::Destroy, &id) == 1));
    node.kill();
    let node = world.start();
    assert_eq!(node.wait_op(&operation)["state"], "succeeded");
    assert_eq!(node.state(&id), "deleted");
    assert!(!world.engine.sandboxes().contains(&id));
}

#[test]
fn a_sandbox_recorded_creating_without_its_create_is_failed() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    // The restart fell between writing the record and its operation.
    let mut record = node.platform.store().node().sandbox(&id).unwrap().unwrap();
    record.sandbox.id = "sbx_00000000000000000000".into();
    record.sandbox.state = SandboxState::Creating;
    node.platform.store().node().put_sandbox(&record).unwrap();
    let orphan = record.sandbox.id.clone();
    node.kill();
    let node = world.start();
    let sandbox = node.wait_state(&orphan, SandboxState::Failed);
    assert!(sandbox["failure_reason"].as_str().unwrap().contains("never accepted"), "{sandbox}");
    assert_eq!(node.state(&id), "running");
}

#[test]
fn leftovers_of_unknown_sandboxes_are_swept_at_start() {
    let world = World::new();
    let node = world.start();
    let id = node.create();
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
    node.kill();
    let stray = world.sandbox_dir("sbx_11111111111111111111");
    std::fs::create_dir_all(stray.join("rootfs")).unwrap();
    // What the server kept of another unknown one, whose engine dir is gone.
    let kept = world.sandbox_state_dir("sbx_22222222222222222222");
    std::fs::create_dir_all(kept.join("commands")).unwrap();
    let node = world.start();
    assert!(world.engine.wait_until(PATIENCE, |_| !stray.exists()), "the unknown sandbox's dir is gone");
    assert!(world.engine.count(Call::Destroy, "sbx_11111111111111111111") >= 1, "swept through the engine");
    assert!(world.engine.wait_until(PATIENCE, |_| !kept.exists()), "what the server kept of it is gone");
    assert!(world.sandbox_dir(&id).is_dir(), "a known sandbox's dir stays");
    assert!(world.sandbox_state_dir(&id).join("commands").is_dir(), "and what the server keeps of it");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
}

#[test]
fn requests_wait_for_a_slow_agent_then_are_served() {
    let world = World::new();
    let node = world.start();
    world.engine.script_agents(AgentScript { hold_redials: true, ..Default::default() });
    let id = node.create();
    node.kill();
    let node = world.start();
    node.platform.set_reconcile_patience(std::time::Duration::from_millis(300));
    // Its agent has not dialed back: the request is told to come again.
    let (status, answer) =
        node.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"argv": ["echo", "early"]})));
    assert_eq!(status, 503, "{answer}");
    assert!(answer["error"]["message"].as_str().unwrap().contains("re-adopted"), "{answer}");
    world.engine.release_redials(&id);
    assert!(node.block_on(node.platform.until_reconciled(&id, PATIENCE)));
    assert_eq!(node.exec(&id, &["echo", "late"])["stdout"], "late\n");
    assert_eq!(node.state(&id), "running");
}
