//! `space template …`: builds, imports and the list.

use anyhow::{bail, Context, Result};

use super::print_json;
use super::sandbox::finish_lifecycle;
use crate::cli::TemplateCommand;
use crate::client;

/// Follows a build operation with a progress bar (steps, and bytes or
/// packages within a step); on failure prints the build log.
pub(crate) fn follow_build(client: &client::Client, name: &str, op: &str) -> Result<()> {
    let bar = indicatif::ProgressBar::new(4);
    bar.set_style(
        indicatif::ProgressStyle::with_template("building {prefix} [{bar:20}] {pos}/{len} {elapsed} {wide_msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_prefix(name.to_string());
    let operation = loop {
        let operation = client.get(&format!("/v1/operations/{op}?wait=1"))?;
        let progress = &operation["progress"];
        bar.set_position(progress["done"].as_u64().unwrap_or(0));
        let mut message = progress["step"].as_str().unwrap_or("").to_string();
        let amount = &progress["amount"];
        if let (Some(done), Some(total)) = (amount["done"].as_u64(), amount["total"].as_u64()) {
            message = match amount["unit"].as_str() {
                Some("bytes") => {
                    format!("{message} ({} of {})", indicatif::HumanBytes(done), indicatif::HumanBytes(total))
                }
                unit => format!("{message} ({done} of {total} {})", unit.unwrap_or("")),
            };
        }
        bar.set_message(message);
        if matches!(operation["state"].as_str(), Some("succeeded" | "failed" | "cancelled")) {
            break operation;
        }
    };
    bar.finish_and_clear();
    if operation["state"] != "succeeded" {
        let log = client.get_text(&format!("/v1/operations/{op}/log")).unwrap_or_default();
        eprintln!("{log}");
        bail!("building {name} failed: {}", operation["error"]["message"].as_str().unwrap_or("unknown error"));
    }
    print_json(&client.get(&format!("/v1/templates/{name}"))?);
    Ok(())
}

pub(crate) fn template(command: TemplateCommand) -> Result<()> {
    match command {
        TemplateCommand::Build { name, debian_packages, suite, client } => {
            let client = client.client()?;
            let request =
                serde_json::json!({"name": name, "from": {"debian": {"suite": suite, "packages": debian_packages}}});
            let accepted = client.post("/v1/templates", &request)?;
            follow_build(&client, &name, accepted["operation"]["id"].as_str().unwrap_or_default())?;
        }
        TemplateCommand::Create { name, from_image, registry_secret, registry_user, workdir, user, client } => {
            let client = client.client()?;
            let image = match registry_secret {
                Some(secret) => serde_json::json!({"reference": from_image,
                    "auth": {"secret": secret, "username": registry_user}}),
                None => serde_json::json!(from_image),
            };
            let mut request = serde_json::json!({"name": name, "from": {"image": image}});
            for (key, value) in [("workdir", workdir), ("user", user)] {
                if let Some(value) = value {
                    request["defaults"][key] = value.into();
                }
            }
            let accepted = client.post("/v1/templates", &request)?;
            follow_build(&client, &name, accepted["operation"]["id"].as_str().unwrap_or_default())?;
        }
        TemplateCommand::ImportOci { file, name, workdir, user, client } => {
            let client = client.client()?;
            let archive = std::fs::File::open(&file).with_context(|| format!("opening {}", file.display()))?;
            let size = archive.metadata()?.len();
            let bar = indicatif::ProgressBar::new(size).with_style(
                indicatif::ProgressStyle::with_template(
                    "uploading {prefix} [{bar:20}] {bytes}/{total_bytes} {bytes_per_sec}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_prefix(name.clone());
            let mut query = format!("/v1/templates?name={}", client::encode(&name));
            for (key, value) in [("workdir", workdir), ("user", user)] {
                if let Some(value) = value {
                    query.push_str(&format!("&{key}={}", client::encode(&value)));
                }
            }
            let accepted = client.post_stream(&query, "application/x-tar", bar.wrap_read(archive));
            bar.finish_and_clear();
            let accepted = accepted?;
            follow_build(&client, &name, accepted["operation"]["id"].as_str().unwrap_or_default())?;
        }
        TemplateCommand::ImportDir { dir, name, data_dir, engine } => {
            let data = space_host::datadir::DataDir::open(&data_dir)?;
            let template =
                space_host::template::import_dir(&data, &name, &dir, &Default::default(), &engine.agent_bin()?, |p| {
                    eprintln!("import: {}", p.step)
                })?;
            eprintln!("template {name}: version {}", template.meta.version);
        }
        TemplateCommand::FromSandbox { name, sandbox, checkpoint, client } => {
            let client = client.client()?;
            let from = match checkpoint {
                Some(checkpoint) => serde_json::json!({"checkpoint": {"sandbox": sandbox, "name": checkpoint}}),
                None => serde_json::json!({"sandbox": sandbox}),
            };
            let accepted = client.post("/v1/templates", &serde_json::json!({"name": name, "from": from}))?;
            finish_lifecycle(&client, &accepted, "the snapshot template")?;
            eprintln!("template {name}: ready");
        }
        TemplateCommand::Ls { client } => {
            let list = client.client()?.get("/v1/templates")?;
            println!("{:<24} {:<9} {:<8} CREATED", "NAME", "STATE", "VERSION");
            for t in list["templates"].as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:<9} {:<8} {}",
                    t["name"].as_str().unwrap_or(""),
                    t["state"].as_str().unwrap_or(""),
                    t["version"].as_u64().map(|v| v.to_string()).unwrap_or_default(),
                    t["created_at"].as_str().unwrap_or("")
                );
            }
        }
        TemplateCommand::Get { name, client } => print_json(&client.client()?.get(&format!("/v1/templates/{name}"))?),
        TemplateCommand::Rm { name, client } => {
            client.client()?.delete_empty(&format!("/v1/templates/{name}"))?;
            eprintln!("deleted template {name}");
        }
    }
    Ok(())
}
