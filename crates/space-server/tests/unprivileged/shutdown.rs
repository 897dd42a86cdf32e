//! A server stopped in-process (`Platform::shutdown`, as `space serve`
//! does on SIGTERM): every background task ends — the loops, the actors,
//! the pools' refills — the warm members go, and the sandboxes keep
//! running for the next server to take back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use space_api::SandboxState;
use space_engine::fake::Call;
use space_engine::LiveStatus;

use crate::harness::{World, PATIENCE};

/// Every background task holds the platform: once none does, none runs,
/// and none can start again.
#[test]
fn after_a_shutdown_no_task_runs_or_holds_the_platform() {
    let world = World::new();
    let mut node = world.start_with(|config| config.warm_pool = 1);
    let running = node.create();
    let paused = node.create();
    assert_eq!(node.act(&paused, "pause")["state"], "succeeded");
    let members = &node.platform.warm();
    assert!(world.engine.wait_until(PATIENCE, |_| members.count() == 1), "the pool never filled");
    assert!(node.platform.background_tasks() > 0, "the loops and actors run before the shutdown");
    node.shut_down();
    assert_eq!(node.platform.background_tasks(), 0);
    // The API's last connections may still be letting go of it.
    let platform = &node.platform;
    let let_go = world.engine.wait_until(PATIENCE, |_| Arc::strong_count(platform) == 1);
    assert!(let_go, "{} holders of the platform besides the test after its shutdown", Arc::strong_count(platform) - 1);
    // Nothing starts after a shutdown.
    node.block_on(async { node.platform.run_until_shutdown(std::future::pending()) });
    assert_eq!(node.platform.background_tasks(), 0, "a task started after the shutdown");
    assert_eq!(world.engine.status_of(&running), LiveStatus::Running);
    assert_eq!(world.engine.status_of(&paused), LiveStatus::Paused);
}

/// The policies' loop acts on a sandbox idle for a second within about a
/// second; after a shutdown it never does. What did not happen is
/// watched for twice as long as the same thing took before the shutdown
/// (and at least 3 s).
#[test]
fn after_a_shutdown_no_policy_acts() {
    let world = World::new();
    let mut node = world.start_with(|config| config.auto_pause_s = 1);
    let started = Instant::now();
    let before = node.create();
    node.wait_state(&before, SandboxState::Paused);
    let took = started.elapsed();
    let after = node.create();
    node.shut_down();
    let watched = (took * 2).max(Duration::from_secs(3));
    let acted = world.engine.wait_until(watched, |engine| engine.idle(&after) || engine.count(Call::Pause, &after) > 0);
    assert!(!acted, "the sandbox was told it is idle or paused after the shutdown");
    let operations = node.platform.store().node().operations(Some(&after)).unwrap();
    assert!(operations.iter().all(|op| op.kind == space_api::OperationKind::Create), "{operations:?}");
    assert_eq!(world.engine.status_of(&after), LiveStatus::Running);
}

/// The sandboxes run on through a shutdown and the next server takes them
/// back; the warm members do not outlive it.
#[test]
fn a_shutdown_drains_the_pools_and_the_next_server_takes_the_sandboxes_back() {
    let world = World::new();
    let mut node = world.start_with(|config| config.warm_pool = 1);
    let id = node.create_with(json!({"env": {"WHO": "kept"}}));
    let paused = node.create();
    assert_eq!(node.act(&paused, "pause")["state"], "succeeded");
    let pools = &node.platform.warm();
    assert!(world.engine.wait_until(PATIENCE, |_| pools.count() == 1), "the pool never filled");
    let member = pools.members()[0].0.clone();
    node.shut_down();
    assert_eq!(world.engine.status_of(&member), LiveStatus::Gone, "the warm member outlived the shutdown");
    assert_eq!(node.platform.warm().count(), 0);
    assert_eq!(world.engine.status_of(&id), LiveStatus::Running);
    assert_eq!(world.engine.status_of(&paused), LiveStatus::Paused);
    assert_eq!(world.engine.count(Call::Stop, &id), 0);
    // The process exits: its connections to the agents close.
    node.kill();
    let node = world.start_with(|config| config.warm_pool = 1);
    assert_eq!(node.exec(&id, &["env", "WHO"])["stdout"], "kept\n");
    assert_eq!(world.engine.agent(&id).unwrap().redials, 1, "its agent redialed to the next server");
    assert_eq!(node.state(&paused), "paused");
    assert_eq!(node.act(&paused, "resume")["state"], "succeeded");
    let pools = &node.platform.warm();
    assert!(world.engine.wait_until(PATIENCE, |_| pools.count() == 1), "the next server's pool never filled");
}
