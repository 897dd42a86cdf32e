//! `space sandbox …` and the lines `space events` prints.

use anyhow::{bail, Result};

use super::print_json;
use crate::cli::SandboxCommand;
use crate::client;

pub(crate) fn sandbox(command: SandboxCommand) -> Result<()> {
    match command {
        SandboxCommand::Create {
            template,
            vcpus,
            memory_mib,
            disk_mib,
            env,
            labels,
            volumes,
            network,
            no_wait,
            quiet,
            client,
        } => {
            let client = client.client()?;
            let network = network.to_json().map(serde_json::from_value).transpose()?;
            let request = space_api::CreateSandboxRequest {
                template,
                vcpus,
                memory_mib,
                disk_mib,
                env: env.into_iter().collect(),
                labels: labels.into_iter().collect(),
                lifecycle: None,
                network,
                volumes,
            };
            let accepted = client.post("/v1/sandboxes", &serde_json::to_value(&request)?)?;
            let id = accepted["sandbox"]["id"].as_str().unwrap_or_default().to_string();
            if !no_wait {
                let op_id = accepted["operation"]["id"].as_str().unwrap_or_default();
                eprintln!("accepted {id}; waiting for operation {op_id} (accepted is not ready)");
                let operation = client.wait_operation(op_id)?;
                if operation["state"] != "succeeded" {
                    bail!("create failed: {}", operation["error"]["message"].as_str().unwrap_or("unknown error"));
                }
            }
            match (quiet, no_wait) {
                (true, _) => println!("{id}"),
                (false, true) => print_json(&accepted),
                (false, false) => print_json(&client.get(&format!("/v1/sandboxes/{id}"))?),
            }
        }
        SandboxCommand::Ls { state, client } => {
            let path = match state {
                Some(state) => format!("/v1/sandboxes?state={state}"),
                None => "/v1/sandboxes".to_string(),
            };
            let list = client.client()?.get(&path)?;
            println!("{:<26} {:<10} {:<10} {:<8} CREATED", "ID", "STATE", "TEMPLATE", "ENGINE");
            for s in list["sandboxes"].as_array().into_iter().flatten() {
                println!(
                    "{:<26} {:<10} {:<10} {:<8} {}",
                    s["id"].as_str().unwrap_or(""),
                    s["state"].as_str().unwrap_or(""),
                    s["template"].as_str().unwrap_or(""),
                    s["engine"].as_str().unwrap_or(""),
                    s["created_at"].as_str().unwrap_or("")
                );
            }
        }
        SandboxCommand::Get { id, client } => print_json(&client.client()?.get(&format!("/v1/sandboxes/{id}"))?),
        SandboxCommand::Network { id, network, client } => {
            let body = network.to_json().unwrap_or_else(|| serde_json::json!({"egress": "none"}));
            print_json(&client.client()?.put(&format!("/v1/sandboxes/{id}/network"), &body)?["network"])
        }
        SandboxCommand::Egress { id, client } => {
            let log = client.client()?.get(&format!("/v1/sandboxes/{id}/egress"))?;
            for event in log["events"].as_array().into_iter().flatten() {
                println!(
                    "{} {:<7} {:<8} {}:{} {}",
                    event["at"].as_str().unwrap_or(""),
                    event["via"].as_str().unwrap_or(""),
                    event["decision"].as_str().unwrap_or(""),
                    event["host"].as_str().unwrap_or(""),
                    event["port"],
                    event["reason"].as_str().or(event["rule"].as_str()).unwrap_or("")
                );
            }
        }
        SandboxCommand::Rm { id, client } => {
            let client = client.client()?;
            let accepted = client.delete(&format!("/v1/sandboxes/{id}"))?;
            finish_lifecycle(&client, &accepted, "delete")?;
            eprintln!("deleted {id}");
        }
        SandboxCommand::Pause { id, client } => {
            let client = client.client()?;
            let accepted = client.post(&format!("/v1/sandboxes/{id}/pause"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "pause")?;
            eprintln!("paused {id}");
        }
        SandboxCommand::Suspend { id, client } => {
            let client = client.client()?;
            let accepted = client.post(&format!("/v1/sandboxes/{id}/suspend"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "suspend")?;
            eprintln!("suspended {id}");
        }
        SandboxCommand::Resume { id, client } => {
            let client = client.client()?;
            let accepted = client.post(&format!("/v1/sandboxes/{id}/resume"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "resume")?;
            eprintln!("resumed {id}");
        }
        SandboxCommand::Fork { id, count, labels, client } => {
            let client = client.client()?;
            let labels: std::collections::BTreeMap<_, _> = labels.into_iter().collect();
            let body = serde_json::json!({"count": count, "labels": labels});
            let accepted = client.post(&format!("/v1/sandboxes/{id}/fork"), &body)?;
            let operation = finish_lifecycle(&client, &accepted, "fork")?;
            eprintln!("forked {id} (frozen {} ms)", operation["frozen_ms"]);
            for fork in accepted["sandboxes"].as_array().into_iter().flatten() {
                println!("{}", fork["id"].as_str().unwrap_or_default());
            }
        }
        SandboxCommand::Checkpoint { id, name, client } => {
            let client = client.client()?;
            let body = serde_json::json!({"name": name});
            let accepted = client.post(&format!("/v1/sandboxes/{id}/checkpoints"), &body)?;
            let operation = finish_lifecycle(&client, &accepted, "checkpoint")?;
            eprintln!("checkpoint {name} of {id} saved (frozen {} ms)", operation["frozen_ms"]);
        }
        SandboxCommand::Checkpoints { id, client } => {
            let list = client.client()?.get(&format!("/v1/sandboxes/{id}/checkpoints"))?;
            println!("{:<24} {:>10} {:<9} CREATED", "NAME", "SIZE_MIB", "COMMANDS");
            for c in list["checkpoints"].as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:>10} {:<9} {}",
                    c["name"].as_str().unwrap_or(""),
                    c["size_bytes"].as_u64().unwrap_or(0).div_ceil(1 << 20),
                    c["commands"].as_array().map_or(0, Vec::len),
                    c["created_at"].as_str().unwrap_or("")
                );
            }
        }
        SandboxCommand::Restore { id, name, client } => {
            let client = client.client()?;
            let accepted =
                client.post(&format!("/v1/sandboxes/{id}/checkpoints/{name}/restore"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "restore")?;
            eprintln!("{id} rolled back to checkpoint {name}");
        }
        SandboxCommand::RmCheckpoint { id, name, client } => {
            client.client()?.delete_empty(&format!("/v1/sandboxes/{id}/checkpoints/{name}"))?;
            eprintln!("deleted checkpoint {name} of {id}");
        }
    }
    Ok(())
}

/// Waits for the operation a lifecycle call started; its failure is ours.
pub(crate) fn finish_lifecycle(
    client: &client::Client,
    accepted: &serde_json::Value,
    what: &str,
) -> Result<serde_json::Value> {
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("{what} failed: {}", operation["error"]["message"].as_str().unwrap_or("unknown error"));
    }
    Ok(operation)
}

/// One line for a person: id, time, type, sandbox, and what changed.
pub(crate) fn describe_event(event: &space_api::Event) -> String {
    let what = if let Some(sandbox) = &event.sandbox {
        let mut text = sandbox.state.as_str().to_string();
        if let Some(reason) = &sandbox.failure_reason {
            text.push_str(&format!(" ({reason})"));
        }
        text
    } else if let Some(op) = &event.operation {
        let subject = op.template.as_deref().map(|t| format!(" template {t}")).unwrap_or_default();
        // The names the API uses.
        let name = |value: serde_json::Value| value.as_str().unwrap_or_default().to_string();
        let (kind, state) = (name(serde_json::json!(op.kind)), name(serde_json::json!(op.state)));
        let mut text = format!(
            "{} {kind}{subject} {state}: {}/{} {}",
            op.id, op.progress.done, op.progress.total, op.progress.step
        );
        if let Some(error) = &op.error {
            text.push_str(&format!(" ({})", error.message));
        }
        text
    } else if let Some(command) = &event.command {
        match &command.result {
            Some(result) => match (&result.exit_code, &result.signal) {
                (Some(code), _) => format!("{} exit {code} after {} ms", command.id, result.duration_ms),
                (None, Some(signal)) => format!("{} killed by {signal} after {} ms", command.id, result.duration_ms),
                (None, None) => {
                    format!("{} ended: {}", command.id, result.error.as_deref().unwrap_or("by the platform"))
                }
            },
            None => format!("{} {}", command.id, command.argv.join(" ")),
        }
    } else {
        "events before this one are no longer kept".to_string()
    };
    format!(
        "#{:<6} {} {:<18} {:<26} {what}",
        event.id,
        event.at,
        event.kind.as_str(),
        event.sandbox_id.as_deref().unwrap_or("-")
    )
}
