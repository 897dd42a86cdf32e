//! Warm (paused) and hot (running, dozing) pool members: filled in the
//! background, handed out to creates of the template's default shape (hot
//! first), refilled behind, never handed out dead, swept after a restart.

use serde_json::json;
use space_engine::fake::{Call, Fault};
use space_engine::LiveStatus;

use crate::harness::{Node, World, PATIENCE};

/// Waits until the pools hold `members`, `hot` of them running.
fn wait_members(world: &World, node: &Node, members: usize, hot: usize) -> Vec<(String, bool)> {
    let warm = &node.platform.warm();
    let filled = world.engine.wait_until(PATIENCE, |_| warm.count() == members && warm.hot_count() == hot);
    assert!(filled, "the pools hold {:?}, not {members} members ({hot} hot)", warm.members());
    warm.members()
}

#[test]
fn warm_members_wait_paused_and_a_create_takes_one() {
    let world = World::new();
    let node = world.start_with(|config| config.warm_pool = 2);
    let members = wait_members(&world, &node, 2, 0);
    for (id, _) in &members {
        assert_eq!(world.engine.status_of(id), LiveStatus::Paused);
    }
    let id = node.create_with(json!({"env": {"WHO": "taker"}}));
    assert!(members.iter().any(|(member, _)| *member == id), "{id} is not one of {members:?}");
    assert_eq!(world.engine.status_of(&id), LiveStatus::Running);
    assert_eq!(world.engine.agent(&id).unwrap().identities, 1, "it took its identity");
    assert_eq!(node.exec(&id, &["env", "WHO"])["stdout"], "taker\n");
    // Refilled behind it.
    wait_members(&world, &node, 2, 0);
}

#[test]
fn a_hot_member_is_handed_out_first_without_a_thaw() {
    let world = World::new();
    let node = world.start_with(|config| {
        config.warm_pool = 1;
        config.hot_pool = 1;
    });
    let members = wait_members(&world, &node, 2, 1);
    let hot = members.iter().find(|(_, hot)| *hot).unwrap().0.clone();
    assert_eq!(world.engine.status_of(&hot), LiveStatus::Running);
    assert!(world.engine.idle(&hot), "a hot member waits dozing");
    let id = node.create();
    assert_eq!(id, hot);
    assert_eq!(world.engine.count(Call::Resume, &id), 0, "a hot member needs no thaw");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
    // Woken as it was handed out (the server never recorded it dozing).
    assert_eq!(world.engine.agent(&id).unwrap().execs_while_idle, 0);
    // The warm member is thawed to take its place.
    let warm = members.iter().find(|(_, hot)| !*hot).unwrap().0.clone();
    assert!(world.engine.wait_until(PATIENCE, |engine| engine.count(Call::Resume, &warm) == 1));
    wait_members(&world, &node, 2, 1);
}

#[test]
fn a_create_of_another_shape_starts_cold() {
    let world = World::new();
    let node = world.start_with(|config| config.warm_pool = 1);
    let members = wait_members(&world, &node, 1, 0);
    let id = node.create_with(json!({"memory_mib": 512}));
    assert_ne!(id, members[0].0);
    assert_eq!(world.engine.count(Call::Create, &id), 1);
    assert_eq!(node.platform.warm().count(), 1, "the member still waits");
}

#[test]
fn a_failed_hand_out_falls_back_to_a_cold_start_under_the_same_id() {
    let world = World::new();
    let node = world.start_with(|config| config.warm_pool = 1);
    let member = wait_members(&world, &node, 1, 0)[0].0.clone();
    world.engine.fault(Call::Resume, Some(&member), Fault::Fail);
    let id = node.create();
    assert_eq!(id, member);
    assert_eq!(world.engine.count(Call::Create, &id), 2, "booted as a member, then cold");
    assert_eq!(world.engine.status_of(&id), LiveStatus::Running);
    assert_eq!(node.exec(&id, &["echo", "cold"])["stdout"], "cold\n");
}

#[test]
fn a_member_that_died_never_fails_a_create() {
    let world = World::new();
    let node = world.start_with(|config| config.warm_pool = 1);
    let member = wait_members(&world, &node, 1, 0)[0].0.clone();
    world.engine.kill(&member);
    let id = node.create();
    assert_eq!(node.state(&id), "running");
    assert_eq!(node.exec(&id, &["true"])["result"]["exit_code"], 0);
}

#[test]
fn a_restarted_server_sweeps_the_members_of_the_one_before() {
    let world = World::new();
    let node = world.start_with(|config| config.warm_pool = 1);
    let old = wait_members(&world, &node, 1, 0)[0].0.clone();
    node.kill();
    let node = world.start_with(|config| config.warm_pool = 1);
    let dir = world.sandbox_dir(&old);
    assert!(world.engine.wait_until(PATIENCE, |_| !dir.exists()), "the old member's dir is swept");
    assert_eq!(world.engine.status_of(&old), LiveStatus::Gone);
    let new = wait_members(&world, &node, 1, 0)[0].0.clone();
    assert_ne!(new, old);
    assert_eq!(node.create(), new);
}

#[test]
fn a_template_may_ask_for_a_pool_of_its_own() {
    let world = World::new();
    world.template("pooled", 1, json!({"warm_pool": 2}));
    let node = world.start();
    wait_members(&world, &node, 2, 0);
    let id = node.create_with(json!({"template": "pooled"}));
    assert!(world.engine.count(Call::Resume, &id) == 1, "handed out from the pool");
    let cold = node.create();
    assert_eq!(world.engine.count(Call::Create, &cold), 1, "the base template keeps no pool");
}
