//! `space volume …`: volumes, their snapshots, and their files without a
//! sandbox (`space cp` copies files in and out with `vol:NAME:/path`).

use anyhow::{bail, Result};

use super::print_json;
use crate::cli::{VolumeCommand, VolumeSnapshotCommand};
use crate::client::{encode, FilesOf};

pub(crate) fn volume(command: VolumeCommand) -> Result<()> {
    match command {
        VolumeCommand::Create { name, size_mib, from_snapshot, client } => {
            let request = space_api::CreateVolumeRequest { name, size_mib, from_snapshot };
            print_json(&client.client()?.post("/v1/volumes", &serde_json::to_value(&request)?)?);
        }
        VolumeCommand::List { client } => {
            let list = client.client()?.get("/v1/volumes")?;
            println!(
                "{:<24} {:>8} {:>10} {:>9} {:<26} CREATED",
                "NAME", "SIZE_MIB", "USED_MIB", "SNAPSHOTS", "MOUNTED_BY"
            );
            for v in list["volumes"].as_array().into_iter().flatten() {
                let holders: Vec<String> = v["mounted_by"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|h| {
                        let id = h["sandbox_id"].as_str().unwrap_or_default();
                        if h["read_only"] == true {
                            format!("{id}(ro)")
                        } else {
                            id.to_string()
                        }
                    })
                    .collect();
                println!(
                    "{:<24} {:>8} {:>10} {:>9} {:<26} {}",
                    v["name"].as_str().unwrap_or(""),
                    v["size_mib"].as_u64().unwrap_or(0),
                    v["used_bytes"].as_u64().unwrap_or(0).div_ceil(1 << 20),
                    v["snapshots"].as_array().map_or(0, Vec::len),
                    if holders.is_empty() { "-".to_string() } else { holders.join(",") },
                    v["created_at"].as_str().unwrap_or("")
                );
            }
        }
        VolumeCommand::Get { name, client } => print_json(&client.client()?.get(&volume_path(&name))?),
        VolumeCommand::Delete { name, client } => {
            client.client()?.delete_empty(&volume_path(&name))?;
            eprintln!("deleted volume {name}");
        }
        VolumeCommand::Snapshot(command) => snapshot(command)?,
        VolumeCommand::Ls { name, path, client } => {
            let listing = client.client()?.list_dir(FilesOf::Volume(&name), &path)?;
            for entry in listing["entries"].as_array().into_iter().flatten() {
                println!(
                    "{:<7} {:<5} {:>12} {} {}",
                    entry["type"].as_str().unwrap_or(""),
                    entry["mode"].as_str().unwrap_or(""),
                    entry["size"].as_u64().unwrap_or(0),
                    entry["mtime"].as_str().unwrap_or(""),
                    entry["name"].as_str().unwrap_or("")
                );
            }
        }
        VolumeCommand::Rm { name, path, recursive, client } => {
            client.client()?.remove_file(FilesOf::Volume(&name), &path, recursive)?;
            eprintln!("removed {path} from volume {name}");
        }
        VolumeCommand::Move { name, node, client } => {
            let client = client.client()?;
            let body = serde_json::to_value(space_api::MoveVolumeRequest { node })?;
            let answer = client.post(&format!("{}/move", volume_path(&name)), &body)?;
            // A move may be an operation (it copies the files): wait for it.
            if let Some(op) = answer["operation"]["id"].as_str() {
                let operation = client.wait_operation(op)?;
                if operation["state"] != "succeeded" {
                    bail!("move failed: {}", operation["error"]["message"].as_str().unwrap_or("unknown error"));
                }
                print_json(&client.get(&volume_path(&name))?);
            } else {
                print_json(&answer);
            }
        }
    }
    Ok(())
}

fn snapshot(command: VolumeSnapshotCommand) -> Result<()> {
    match command {
        VolumeSnapshotCommand::Create { volume, name, client } => {
            let body = serde_json::to_value(space_api::CreateVolumeSnapshotRequest { name })?;
            print_json(&client.client()?.post(&format!("{}/snapshots", volume_path(&volume)), &body)?);
        }
        VolumeSnapshotCommand::List { volume, client } => {
            let list = client.client()?.get(&format!("{}/snapshots", volume_path(&volume)))?;
            println!("{:<24} {:>10} CREATED", "NAME", "SIZE_MIB");
            for s in list["snapshots"].as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:>10} {}",
                    s["name"].as_str().unwrap_or(""),
                    s["size_bytes"].as_u64().unwrap_or(0).div_ceil(1 << 20),
                    s["created_at"].as_str().unwrap_or("")
                );
            }
        }
        VolumeSnapshotCommand::Delete { volume, name, client } => {
            client.client()?.delete_empty(&format!("{}/snapshots/{}", volume_path(&volume), encode(&name)))?;
            eprintln!("deleted snapshot {name} of volume {volume}");
        }
        VolumeSnapshotCommand::Restore { volume, name, client } => {
            let path = format!("{}/snapshots/{}/restore", volume_path(&volume), encode(&name));
            print_json(&client.client()?.post(&path, &serde_json::json!({}))?);
        }
    }
    Ok(())
}

fn volume_path(name: &str) -> String {
    format!("/v1/volumes/{}", encode(name))
}
