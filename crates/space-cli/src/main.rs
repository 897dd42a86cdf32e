//! `space`: one binary that prepares the host, serves the API, and is the
//! command-line client. It parses arguments and wires parts together; the
//! logic lives in the library crates.

mod attach;
mod bench;
mod cli;
mod cmd;
mod forward;
mod mcp;
mod run;
mod setup;

use anyhow::Result;
use clap::Parser;
use space_client as client;

use crate::cli::{Cli, NodeArgs, OpCommand, Top};
use crate::cmd::{copy, describe_event, doctor, exec, keys, print_json, run_code, sandbox, secret, template, volume};
use crate::run::{control_plane, serve, NodeRole};

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("space: {err:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Top::Setup(args) => setup::run(args).map(|()| 0),
        Top::Serve(args) if args.cluster => control_plane(args).map(|()| 0),
        Top::Serve(args) => serve(args, None).map(|()| 0),
        Top::Node(node) => {
            let NodeArgs { serve: args, control_plane, node_id, advertise } = node;
            let id = match node_id {
                Some(id) => id,
                None => nix::unistd::gethostname()?.to_string_lossy().into_owned(),
            };
            serve(args, Some(NodeRole { control_plane, id, advertise })).map(|()| 0)
        }
        Top::Sandbox(command) => sandbox(command).map(|()| 0),
        Top::Exec(args) => exec(args),
        Top::Run(args) => run_code(args),
        Top::Op(OpCommand::Get { id, wait, client }) => {
            let path = match wait {
                Some(s) => format!("/v1/operations/{id}?wait={s}"),
                None => format!("/v1/operations/{id}"),
            };
            print_json(&client.client()?.get(&path)?);
            Ok(0)
        }
        Top::Op(OpCommand::Wait { id, client }) => {
            let operation = client.client()?.wait_operation(&id)?;
            print_json(&operation);
            Ok(if operation["state"] == "succeeded" { 0 } else { 1 })
        }
        Top::Template(command) => template(command).map(|()| 0),
        Top::Secret(command) => secret(command).map(|()| 0),
        Top::Volume(command) => volume(command).map(|()| 0),
        Top::Cp { from, to, mode, client } => copy(&client.client()?, &from, &to, mode).map(|()| 0),
        Top::Bench(args) => bench::run(args).map(|()| 0),
        Top::Keys(command) => keys(command).map(|()| 0),
        Top::Events { follow, from, types, sandbox, json, client } => {
            let mut query = vec![];
            if let Some(types) = types {
                query.push(format!("types={}", client::encode(&types)));
            }
            if let Some(sandbox) = sandbox {
                query.push(format!("sandbox_id={}", client::encode(&sandbox)));
            }
            client.client()?.events(&query.join("&"), from, follow, |event| {
                match json {
                    true => println!("{}", serde_json::to_string(&event).unwrap_or_default()),
                    false => println!("{}", describe_event(&event)),
                }
                Ok::<(), anyhow::Error>(())
            })?;
            Ok(0)
        }
        Top::Mcp { client } => mcp::serve(&client.client()?).map(|()| 0),
        Top::PortForward { sandbox, ports, client } => {
            let (local, remote) = forward::parse_ports(&ports)?;
            forward::run(&client.client()?, &sandbox, local, remote).map(|()| 0)
        }
        Top::Helper(args) => run::helper(args).map(|()| 0),
        // Before any thread: it confines itself first.
        Top::ImportOciChild(args) => {
            let args = space_engine::templates::importer::ChildArgs {
                build_dir: args.build_dir,
                max_bytes: args.max_bytes,
                root_tar: args.root_tar,
                layer: args.layer,
                layer_digest: args.layer_digest,
                diff_id: args.diff_id,
            };
            Ok(space_engine::templates::importer::child_main(&args))
        }
        // Before any thread: it confines itself first.
        Top::VolumeFilesChild { data } => {
            Ok(space_engine::volumes::files_child_main(&space_engine::volumes::FilesChildArgs { data }))
        }
        Top::Doctor { data_dir, engine } => doctor(&data_dir, &engine),
    }
}
