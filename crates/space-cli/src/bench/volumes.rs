//! `space bench --only-volumes`: volumes (issue 37) beside the floor of
//! the same work done on the host directly, in one run.
//!
//! - create: `POST /v1/volumes` answered (a subvolume, its size limit, its
//!   record), against `btrfs subvolume create` + `btrfs qgroup limit` run
//!   here on the same filesystem;
//! - a 1 GiB sequential write (`dd … conv=fsync`) inside one sandbox to a
//!   volume, against the same write to the sandbox's own root and the same
//!   write on the host into the data dir's filesystem, in turn;
//! - a snapshot of a volume holding 1 GiB (`POST /v1/volumes/{name}/snapshots`
//!   answered), against `btrfs subvolume snapshot -r` of a 1 GiB subvolume
//!   here.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use serde_json::json;
use space_host::datadir::DataDir;

use super::{start_server, Samples};
use crate::cli::BenchArgs;
use crate::client::Client;

/// Volumes created for the create figure.
const CREATES: usize = 20;
/// Rounds of the write and snapshot figures.
const ROUNDS: usize = 3;
/// Issue 37's goals.
const CREATE_GOAL_MS: f64 = 20.0;
const WRITE_GOAL: f64 = 0.8;
const SNAPSHOT_GOAL_MS: f64 = 50.0;
const GIB_WRITE: &str = "dd if=/dev/zero of=FILE bs=1M count=1024 conv=fsync status=none && rm FILE";

fn timed<T>(work: impl FnOnce() -> Result<T>) -> Result<(T, Duration)> {
    let started = Instant::now();
    let value = work()?;
    Ok((value, started.elapsed()))
}

/// A command run to its end inside `sandbox`, which must succeed; its time
/// as the sandbox's agent measured it (start to exit).
fn run_in(client: &Client, sandbox: &str, cmd: &str) -> Result<Duration> {
    let ran = client.post(&format!("/v1/sandboxes/{sandbox}/exec"), &json!({"cmd": cmd, "timeout_s": 600}))?;
    ensure!(ran["result"]["exit_code"] == 0, "{cmd}: {ran}");
    let ms = ran["result"]["duration_ms"].as_f64().context("a result's duration_ms")?;
    Ok(Duration::from_secs_f64(ms / 1000.0))
}

/// The floor of the write: 1 GiB in 1 MiB writes, then fsync, here on the
/// data dir's filesystem (what `dd … conv=fsync` does).
fn host_write(path: &std::path::Path) -> Result<Duration> {
    use std::io::Write;
    let chunk = vec![0u8; 1 << 20];
    let (_, took) = timed(|| {
        let mut file = std::fs::File::create(path)?;
        for _ in 0..1024 {
            file.write_all(&chunk)?;
        }
        file.sync_all()?;
        Ok(())
    })?;
    std::fs::remove_file(path)?;
    Ok(took)
}

pub(crate) fn run(args: &BenchArgs, data: &DataDir) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let mut config = args.engine.platform_config(data.root())?;
    (config.warm_pool, config.hot_pool) = (0, 0);
    let (client, platform) = start_server(&runtime, config)?;

    // Create, through the API and on the host.
    let mut created = Samples(vec![]);
    let mut floor_created = Samples(vec![]);
    let floor_dir = data.root().join("bench-volumes-floor");
    std::fs::create_dir_all(&floor_dir)?;
    for n in 0..CREATES {
        let name = format!("bench-{n}");
        let (_, took) = timed(|| Ok(client.post("/v1/volumes", &json!({"name": name, "size_mib": 1024}))?))?;
        created.0.push(took);
        let path = floor_dir.join(format!("v{n}"));
        let (_, took) = timed(|| {
            space_host::btrfs::create_subvolume(&path)?;
            space_host::btrfs::limit_exclusive(&path, 1024)?;
            Ok(())
        })?;
        floor_created.0.push(took);
    }
    for n in 0..CREATES {
        client.delete_empty(&format!("/v1/volumes/bench-{n}"))?;
        space_host::btrfs::delete_subvolume(&floor_dir.join(format!("v{n}")))?;
    }

    // A 1 GiB write to a volume and to the root, in one sandbox.
    client.post("/v1/volumes", &json!({"name": "io", "size_mib": 3072}))?;
    let accepted = client.post(
        "/v1/sandboxes",
        &json!({"template": args.template, "disk_mib": 4096, "volumes": [{"name": "io", "path": "/vol"}]}),
    )?;
    let sandbox = accepted["sandbox"]["id"].as_str().context("a sandbox id")?.to_string();
    client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    let (mut to_volume, mut to_root, mut on_host) = (Samples(vec![]), Samples(vec![]), Samples(vec![]));
    for _ in 0..ROUNDS {
        to_volume.0.push(run_in(&client, &sandbox, &GIB_WRITE.replace("FILE", "/vol/gib"))?);
        to_root.0.push(run_in(&client, &sandbox, &GIB_WRITE.replace("FILE", "/root/gib"))?);
        on_host.0.push(host_write(&floor_dir.join("gib"))?);
    }
    // A volume holding 1 GiB, snapshotted.
    run_in(&client, &sandbox, "dd if=/dev/zero of=/vol/held bs=1M count=1024 conv=fsync status=none")?;
    let mut snapshots = Samples(vec![]);
    for n in 0..ROUNDS {
        let (_, took) = timed(|| Ok(client.post("/v1/volumes/io/snapshots", &json!({"name": format!("s{n}")}))?))?;
        snapshots.0.push(took);
    }
    let deleted = client.delete(&format!("/v1/sandboxes/{sandbox}"))?;
    client.wait_operation(deleted["operation"]["id"].as_str().unwrap_or_default())?;
    client.delete_empty("/v1/volumes/io")?;

    // The floor: a 1 GiB subvolume snapshotted here.
    let held = floor_dir.join("held");
    space_host::btrfs::create_subvolume(&held)?;
    std::fs::write(held.join("held"), vec![0u8; 1 << 30])?;
    nix::unistd::sync();
    let mut floor_snapshots = Samples(vec![]);
    for n in 0..ROUNDS {
        let dest = floor_dir.join(format!("held-s{n}"));
        let (_, took) = timed(|| {
            space_host::run(
                std::process::Command::new("btrfs").args(["subvolume", "snapshot", "-r"]).arg(&held).arg(&dest),
            )?;
            Ok(())
        })?;
        floor_snapshots.0.push(took);
        space_host::btrfs::delete_subvolume(&dest)?;
    }
    space_host::btrfs::delete_subvolume(&held)?;
    let _ = std::fs::remove_dir(&floor_dir);
    runtime.block_on(platform.shutdown());

    let mbps = |samples: &Samples| 1024.0 * 1.048_576 / (samples.percentile(50.0) / 1000.0);
    let (create_ms, floor_create_ms) = (created.percentile(50.0), floor_created.percentile(50.0));
    let (volume_mbps, root_mbps, host_mbps) = (mbps(&to_volume), mbps(&to_root), mbps(&on_host));
    let (snapshot_ms, floor_snapshot_ms) = (snapshots.percentile(50.0), floor_snapshots.percentile(50.0));
    let verdict = |met: bool| if met { "goal met" } else { "goal missed" };
    println!("{:<48} {:>9.1} ms", "volume create (API), p50", create_ms);
    println!("{:<48} {:>9.1} ms", "volume create (API), p95", created.percentile(95.0));
    println!("{:<48} {:>9.1} ms", "btrfs subvolume create + qgroup limit (floor), p50", floor_create_ms);
    println!("{:<48} {:>9} ({CREATE_GOAL_MS} ms)", "create goal", verdict(create_ms <= CREATE_GOAL_MS));
    println!("{:<48} {:>9.0} MB/s", "1 GiB write in a sandbox to a volume, p50", volume_mbps);
    println!("{:<48} {:>9.0} MB/s", "1 GiB write in a sandbox to its root, p50", root_mbps);
    println!("{:<48} {:>9.0} MB/s", "1 GiB write on the host, same disk (floor), p50", host_mbps);
    println!("{:<48} {:>9.2} ×", "volume / host", volume_mbps / host_mbps);
    println!(
        "{:<48} {:>9.2} × ({} ≥ {WRITE_GOAL}×)",
        "volume / root",
        volume_mbps / root_mbps,
        verdict(volume_mbps / root_mbps >= WRITE_GOAL)
    );
    println!("{:<48} {:>9.1} ms", "snapshot of a volume holding 1 GiB (API), p50", snapshot_ms);
    println!("{:<48} {:>9.1} ms", "btrfs subvolume snapshot -r of 1 GiB (floor), p50", floor_snapshot_ms);
    println!("{:<48} {:>9} ({SNAPSHOT_GOAL_MS} ms)", "snapshot goal", verdict(snapshot_ms <= SNAPSHOT_GOAL_MS));
    Ok(())
}
