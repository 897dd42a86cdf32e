//! `space bench --cluster`: create and exec latency through a cluster's
//! control plane to a node, next to a single-host server, in one run and
//! one process: two clusters on loopback (each a throwaway PostgreSQL, a
//! control plane and a node; one of them speaking mutual TLS between
//! control plane and node), and a single-host server, each over a scratch
//! data dir of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use space_host::datadir::DataDir;

use space_server::http::ClusterTls;

use crate::bench::{start_server, timed_create, timed_true, BenchArgs, Samples};
use crate::client::Client;

fn random_hex() -> Result<String> {
    let mut bytes = [0u8; 24];
    getrandom::getrandom(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Mutual TLS for a control plane and a node on loopback: a CA made here,
/// and a certificate of it for each (PEM files in `dir`).
fn loopback_tls(dir: &std::path::Path) -> Result<(ClusterTls, ClusterTls)> {
    std::fs::create_dir_all(dir)?;
    let ca_key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.distinguished_name.push(rcgen::DnType::CommonName, "space bench cluster CA");
    let ca = params.self_signed(&ca_key)?;
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem())?;
    let member = |name: &str| -> Result<ClusterTls> {
        let key = rcgen::KeyPair::generate()?;
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &ca, &ca_key)?;
        let (cert_file, key_file) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        std::fs::write(&cert_file, cert.pem())?;
        std::fs::write(&key_file, key.serialize_pem())?;
        Ok(space_server::http::cluster_tls(&ca_file, &cert_file, &key_file)?)
    };
    Ok((member("control-plane")?, member("node")?))
}

/// A control plane over a throwaway PostgreSQL and one node, on loopback
/// (the two speaking mutual TLS when `tls` is given); a client of the
/// control plane once the node has reported.
fn start_cluster(
    runtime: &tokio::runtime::Runtime,
    config: space_server::PlatformConfig,
    tls: Option<(ClusterTls, ClusterTls)>,
) -> Result<(Client, space_host::postgres::Throwaway)> {
    let pg = space_host::postgres::Throwaway::start().map_err(|e| anyhow::anyhow!(e))?;
    let (key, token) = (random_hex()?, random_hex()?);
    let (cp_tls, node_tls) = tls.unzip();
    let cp = Arc::new(space_control::ControlPlane::new(space_control::Config {
        store: space_server::store::Store::connect(&pg.url)?,
        api_key: key.clone(),
        node_token: token.clone(),
        keyring: None,
        links: space_server::cluster::Links::new(cp_tls.map(|t| t.client)),
        openapi: space_server::api::openapi::document_json(),
    }));
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let cp_url = format!("http://{}", listener.local_addr()?);
    let router = space_control::router(cp);
    runtime.spawn(space_server::http::serve_router(listener, router, None, std::future::pending()));

    let platform = space_server::start_platform(&config)?;
    runtime.block_on(platform.start()).map_err(|e| anyhow::anyhow!(e.message))?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let scheme = if node_tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{}", listener.local_addr()?);
    let links = space_server::cluster::Links::new(node_tls.as_ref().map(|t| t.client.clone()));
    let state = space_server::AppState::node(platform.clone(), token.clone(), links.clone());
    let served = space_server::http::serve_with(listener, state, node_tls.map(|t| t.server), std::future::pending());
    runtime.spawn(served);
    runtime.spawn(space_server::cluster::heartbeats(platform, links, cp_url.clone(), token, "bench-node".into(), url));

    let through = Client::new(&cp_url, &key);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let health = through.get("/v1/health")?;
        if health["nodes"].as_array().is_some_and(|n| n.iter().any(|n| n["alive"] == true)) {
            return Ok((through, pg));
        }
        if Instant::now() > deadline {
            bail!("the node never reported to the control plane");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
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

pub fn run(args: &BenchArgs, node_data: &DataDir, tls_node_data: &DataDir, single_data: &DataDir) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let config = |data: &DataDir| -> Result<space_server::PlatformConfig> {
        let mut config = args.engine.platform_config(data.root())?;
        config.warm_pool = 0;
        config.hot_pool = 0;
        config.auto_pause_s = 0;
        Ok(config)
    };
    let (through, _pg) = start_cluster(&runtime, config(node_data)?, None)?;
    let tls = loopback_tls(&tls_node_data.root().join("bench-tls"))?;
    let (through_tls, _pg_tls) = start_cluster(&runtime, config(tls_node_data)?, Some(tls))?;
    let (single, _platform) = start_server(&runtime, config(single_data)?)?;
    let mut samples: Vec<(Samples, Samples)> = (0..3).map(|_| (Samples(vec![]), Samples(vec![]))).collect();
    eprintln!("bench --cluster: {} sandboxes each way, {} execs each, interleaved", args.runs, args.execs);
    for i in 0..args.runs {
        for (client, (create, exec)) in [&through, &through_tls, &single].into_iter().zip(samples.iter_mut()) {
            one_sandbox(client, args, create, exec)?;
        }
        eprint!("\rbench --cluster: {}/{} ", i + 1, args.runs);
    }
    eprintln!();
    let [(cp_create, cp_exec), (tls_create, tls_exec), (single_create, single_exec)] =
        <[(Samples, Samples); 3]>::try_from(samples).map_err(|_| anyhow::anyhow!("three ways"))?;
    println!("{:<52} {:>9} {:>9} {:>6}", "figure (ms)", "p50", "p95", "n");
    let row = |name: &str, s: &Samples| {
        println!("{name:<52} {:>9.1} {:>9.1} {:>6}", s.percentile(50.0), s.percentile(95.0), s.0.len())
    };
    let ratio = |name: &str, top: &Samples, bottom: &Samples| {
        let at = |p| top.percentile(p) / bottom.percentile(p);
        println!("{name:<52} {:>9.2} {:>9.2}", at(50.0), at(95.0));
    };
    row("create -> ready, through the control plane", &cp_create);
    row("create -> ready, through it over mutual TLS", &tls_create);
    row("create -> ready, single host", &single_create);
    ratio("ratio cluster/single host", &cp_create, &single_create);
    row("exec `true`, through the control plane", &cp_exec);
    row("exec `true`, through it over mutual TLS", &tls_exec);
    row("exec `true`, single host", &single_exec);
    ratio("ratio cluster/single host (goal <= 1.3)", &cp_exec, &single_exec);
    ratio("ratio cluster over mutual TLS/single host", &tls_exec, &single_exec);
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}
