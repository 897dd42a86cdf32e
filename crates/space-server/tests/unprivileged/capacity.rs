//! Host capacity: memory promised to sandboxes that hold it (and to pool
//! members) never passes the host's; a create or resume past it is refused
//! with 503 `capacity` and room comes back as sandboxes let go of memory.

use serde_json::json;
use space_engine::fake::{Call, Fault};

use crate::harness::{World, MEMORY_MIB, PATIENCE};

#[test]
fn creates_past_capacity_are_refused_until_room_comes_back() {
    let world = World::new();
    let node = world.start_with(|config| config.capacity_mib = Some(2 * MEMORY_MIB));
    let first = node.create();
    let _second = node.create();
    let refused = node.refused("POST", "/v1/sandboxes", Some(json!({"template": "base"})), 503, "capacity");
    assert_eq!(refused["error"]["details"]["reserved_mib"], 2 * MEMORY_MIB, "{refused}");
    assert_eq!(node.delete(&first)["state"], "succeeded");
    let third = node.create();
    assert_eq!(node.state(&third), "running");
}

#[test]
fn a_suspended_sandbox_holds_no_memory_and_its_resume_needs_room() {
    let world = World::new();
    let node = world.start_with(|config| config.capacity_mib = Some(2 * MEMORY_MIB));
    let sleeper = node.create();
    assert_eq!(node.act(&sleeper, "suspend")["state"], "succeeded");
    assert_eq!(node.platform.reserved_mib(), 0);
    let _a = node.create();
    let b = node.create();
    node.refused("POST", &format!("/v1/sandboxes/{sleeper}/resume"), None, 503, "capacity");
    assert_eq!(node.state(&sleeper), "suspended");
    assert_eq!(world.engine.count(Call::Restore, &sleeper), 0);
    // A paused sandbox still holds its memory; a deleted one does not.
    assert_eq!(node.act(&b, "pause")["state"], "succeeded");
    node.refused("POST", &format!("/v1/sandboxes/{sleeper}/resume"), None, 503, "capacity");
    assert_eq!(node.delete(&b)["state"], "succeeded");
    assert_eq!(node.act(&sleeper, "resume")["state"], "succeeded");
}

#[test]
fn pool_members_count_toward_capacity() {
    let world = World::new();
    let node = world.start_with(|config| {
        config.capacity_mib = Some(2 * MEMORY_MIB);
        config.warm_pool = 4;
    });
    let warm = &node.platform.warm();
    assert!(world.engine.wait_until(PATIENCE, |_| warm.count() == 2), "members: {:?}", warm.members());
    assert_eq!(node.platform.reserved_mib(), 2 * MEMORY_MIB);
    // A create the members cannot serve finds no room.
    node.refused("POST", "/v1/sandboxes", Some(json!({"template": "base", "memory_mib": 128})), 503, "capacity");
    // One they can serve takes a member, whose memory was counted already.
    let id = node.create();
    assert_eq!(world.engine.count(Call::Resume, &id), 1);
    assert_eq!(warm.count(), 1);
}

#[test]
fn a_failed_create_gives_its_room_back() {
    let world = World::new();
    let node = world.start_with(|config| config.capacity_mib = Some(MEMORY_MIB));
    world.engine.fault(Call::Create, None, Fault::Fail);
    let (_, operation) = node.create_started(json!({"template": "base"}));
    assert_eq!(node.wait_op(&operation)["state"], "failed");
    let id = node.create();
    assert_eq!(node.state(&id), "running");
}
