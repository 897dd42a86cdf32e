//! `space template …`: builds, imports and the list.

use std::io::Read;
use std::path::{Path, PathBuf};

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
        TemplateCommand::Build {
            template,
            context,
            name,
            file,
            build_args,
            target,
            registry_secret,
            registry_user,
            debian_packages,
            suite,
            network,
            client,
        } => {
            let name = match (template, name) {
                (Some(name), None) | (None, Some(name)) => name,
                (Some(_), Some(_)) => bail!("name the template once: NAME or --name"),
                (None, None) => bail!("name the template: space template build NAME -f Dockerfile DIR"),
            };
            let client = client.client()?;
            let accepted = match (file, debian_packages.is_empty()) {
                (Some(file), true) => {
                    let auth =
                        registry_secret.map(|secret| serde_json::json!({"secret": secret, "username": registry_user}));
                    let build = DockerfileBuild { name: &name, file: &file, build_args, target, network, auth };
                    post_dockerfile_build(&client, &build, &context.unwrap_or_else(|| PathBuf::from(".")))?
                }
                (None, false) => {
                    let suite = suite.unwrap_or_else(|| "bookworm".into());
                    let request = serde_json::json!({"name": name,
                        "from": {"debian": {"suite": suite, "packages": debian_packages}}});
                    client.post("/v1/templates", &request)?
                }
                _ => bail!("build from a Dockerfile (-f FILE DIR) or from Debian packages (--debian-packages)"),
            };
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

/// A `space template build -f` request.
struct DockerfileBuild<'a> {
    name: &'a str,
    file: &'a Path,
    build_args: Vec<(String, String)>,
    target: Option<String>,
    network: crate::cli::NetworkArgs,
    /// The registry credential for `FROM` images (`{secret, username}`).
    auth: Option<serde_json::Value>,
}

/// Posts a Dockerfile build: the form's part `build` (the request), then
/// part `context` (`dir` as a tar without what its `.dockerignore`
/// excludes, streamed from a file made beside it in the temp dir).
fn post_dockerfile_build(
    client: &client::Client,
    build: &DockerfileBuild<'_>,
    dir: &Path,
) -> Result<serde_json::Value> {
    let dockerfile = std::fs::read_to_string(build.file)
        .with_context(|| format!("reading the Dockerfile {}", build.file.display()))?;
    let mut request = serde_json::json!({"name": build.name, "dockerfile": dockerfile,
        "build_args": build.build_args.iter().cloned().collect::<std::collections::BTreeMap<_, _>>()});
    if let Some(target) = &build.target {
        request["target"] = target.clone().into();
    }
    if let Some(network) = build.network.to_json() {
        request["network"] = network;
    }
    if let Some(auth) = &build.auth {
        request["registry_auth"] = auth.clone();
    }
    let ignore = match std::fs::read_to_string(dir.join(".dockerignore")) {
        Ok(text) => space_dockerfile::Ignore::parse(&text).map_err(|e| anyhow::anyhow!(".dockerignore: {e}"))?,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => space_dockerfile::Ignore::default(),
        Err(err) => return Err(err).context("reading .dockerignore"),
    };
    // The Dockerfile as the context names it, when it is inside it.
    let in_context = build.file.strip_prefix(dir).ok().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    let mut tar_file = tempfile_in(&std::env::temp_dir())?;
    {
        let mut tar = tar::Builder::new(std::io::BufWriter::new(&mut tar_file));
        tar.follow_symlinks(false);
        append_context(&mut tar, dir, Path::new(""), &ignore, &in_context)?;
        tar.into_inner()?.into_inner().map_err(|e| e.into_error())?;
    }
    std::io::Seek::rewind(&mut tar_file)?;
    post_build_form(client, &request, tar_file)
}

/// `POST /v1/templates/builds`: the form's part `build` (`request`), then
/// part `context` (a tar, streamed).
pub(crate) fn post_build_form(
    client: &client::Client,
    request: &serde_json::Value,
    context: impl Read,
) -> Result<serde_json::Value> {
    let boundary = format!("space-build-{}", std::process::id());
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"build\"\r\nContent-Type: application/json\r\n\r\n{request}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"context\"; filename=\"context.tar\"\r\n\
         Content-Type: application/x-tar\r\n\r\n"
    );
    let tail = format!("\r\n--{boundary}--\r\n");
    let body = std::io::Cursor::new(head.into_bytes()).chain(context).chain(std::io::Cursor::new(tail.into_bytes()));
    Ok(client.post_stream("/v1/templates/builds", &format!("multipart/form-data; boundary={boundary}"), body)?)
}

/// An unnamed file in `dir` (removed as soon as it is made).
fn tempfile_in(dir: &Path) -> Result<std::fs::File> {
    let path =
        dir.join(format!("space-context-{}-{}.tar", std::process::id(), std::time::UNIX_EPOCH.elapsed()?.as_nanos()));
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

/// Adds what `dir/rel` holds to `tar`, named relative to the context root,
/// except what `.dockerignore` excludes; links are kept as links.
fn append_context<W: std::io::Write>(
    tar: &mut tar::Builder<W>,
    root: &Path,
    rel: &Path,
    ignore: &space_dockerfile::Ignore,
    dockerfile: &str,
) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(root.join(rel))
        .with_context(|| format!("reading {}", root.join(rel).display()))?
        .collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|entry| entry.file_name());
    for entry in entries {
        let name = rel.join(entry.file_name());
        let text = name.to_string_lossy();
        if ignore.sends(&text, dockerfile) {
            tar.append_path_with_name(entry.path(), &name).with_context(|| format!("packing {text}"))?;
        }
        // Into an excluded directory too: a `!` line may send what is in it.
        if entry.file_type()?.is_dir() {
            append_context(tar, root, &name, ignore, dockerfile)?;
        }
    }
    Ok(())
}
