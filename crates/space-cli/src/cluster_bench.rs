//! `space bench --cluster`: create and exec latency through a cluster's
//! control plane to a node, next to a single-host server, in one run and
//! one process: a throwaway PostgreSQL, a control plane and a node on
//! loopback, and a single-host server over another scratch data dir.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use space_host::datadir::DataDir;

use crate::bench::{start_server, timed_create, timed_true, BenchArgs, Samples};
use crate::client::Client;

fn random_hex() -> Result<String> {
    let mut bytes = [0u8; 24];
    getrandom::getrandom(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A node on loopback reporting to `control_plane`.
fn start_node(
    runtime: &tokio::runtime::Runtime,
    config: space_server::PlatformConfig,
    control_plane: &str,
    token: &str,
) -> Result<()> {
    let platform = space_server::start_platform(&config)?;
    runtime.block_on(platform.start()).map_err(|e| anyhow::anyhow!(e.message))?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}", listener.local_addr()?);
    let state = space_server::AppState::node(platform.clone(), token.to_string(), Default::default());
    runtime.spawn(space_server::serve(listener, state, std::future::pending()));
    runtime.spawn(space_server::cluster::heartbeats(
        platform,
        Default::default(),
        control_plane.to_string(),
        token.to_string(),
        "bench-node".into(),
        url,
    ));
    Ok(())
}

/// Create → ready, and `execs` exec round trips, through `client`.
fn one_sandbox(client: &Client, args: &BenchArgs, create: &mut Samples, exec: &mut Samples) -> Result<()> {
    let id = timed_create(client, &args.template, create)?;
    for _ in 0..args.execs {
        timed_true(client, &id, exec)?;
    }
    let deleted = client.delete(&format!("/v1/sandboxes/{id}"))?;
    client.wait_operation(deleted["operation"]["id"].as_str().unwrap_or_default())?;
    Ok(())
}

pub fn run(args: &BenchArgs, node_data: &DataDir, single_data: &DataDir) -> Result<()> {
    let pg = space_host::postgres::Throwaway::start().map_err(|e| anyhow::anyhow!(e))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let (key, token) = (random_hex()?, random_hex()?);
    let store = space_server::store::Store::connect(&pg.url)?;
    let cp = Arc::new(space_server::cluster::ControlPlane {
        store,
        api_key: key.clone(),
        node_token: token.clone(),
        keyring: None,
        links: Default::default(),
    });
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let cp_url = format!("http://{}", listener.local_addr()?);
    runtime.spawn(space_server::http::serve_router(
        listener,
        space_server::cluster::router(cp),
        None,
        std::future::pending(),
    ));
    let config = |data: &DataDir| -> Result<space_server::PlatformConfig> {
        let mut config = args.engine.platform_config(data.root())?;
        config.warm_pool = 0;
        config.auto_pause_s = 0;
        Ok(config)
    };
    start_node(&runtime, config(node_data)?, &cp_url, &token)?;
    let (single, _platform) = start_server(&runtime, config(single_data)?)?;
    let through = Client::new(&cp_url, &key);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let health = through.get("/v1/health")?;
        if health["nodes"].as_array().is_some_and(|n| n.iter().any(|n| n["alive"] == true)) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the node never reported to the control plane");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (mut cp_create, mut cp_exec, mut single_create, mut single_exec) =
        (Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]));
    eprintln!("bench --cluster: {} sandboxes each way, {} execs each, interleaved", args.runs, args.execs);
    for i in 0..args.runs {
        one_sandbox(&through, args, &mut cp_create, &mut cp_exec)?;
        one_sandbox(&single, args, &mut single_create, &mut single_exec)?;
        eprint!("\rbench --cluster: {}/{} ", i + 1, args.runs);
    }
    eprintln!();
    println!("{:<44} {:>9} {:>9} {:>6}", "figure (ms)", "p50", "p95", "n");
    let row = |name: &str, s: &Samples| {
        println!("{name:<44} {:>9.1} {:>9.1} {:>6}", s.percentile(50.0), s.percentile(95.0), s.0.len())
    };
    let ratio = |name: &str, top: &Samples, bottom: &Samples| {
        let at = |p| top.percentile(p) / bottom.percentile(p);
        println!("{name:<44} {:>9.2} {:>9.2}", at(50.0), at(95.0));
    };
    row("create -> ready, through the control plane", &cp_create);
    row("create -> ready, single host", &single_create);
    ratio("ratio cluster/single host", &cp_create, &single_create);
    row("exec `true`, through the control plane", &cp_exec);
    row("exec `true`, single host", &single_exec);
    ratio("ratio cluster/single host (goal <= 1.3)", &cp_exec, &single_exec);
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(pg);
    Ok(())
}
