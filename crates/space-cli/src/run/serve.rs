//! `space serve` and `space node`: the API server of one host, alone or as
//! a cluster's node.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use space_privsep::confine::{Confined, Confinement};

use super::{dev_key, init_logging, read_secret_file, NodeRole};
use crate::cli::ServeArgs;

pub(crate) fn serve(args: ServeArgs, node: Option<NodeRole>) -> Result<()> {
    init_logging(args.log_format);
    if args.dev && !args.listen.ip().is_loopback() {
        bail!("--dev binds loopback only; {} is not a loopback address", args.listen);
    }
    // A node of a cluster with TLS serves the cluster's mutual TLS.
    let cluster_tls = args.cluster_tls()?;
    let tls = match (&args.tls_cert, &args.tls_key, &cluster_tls) {
        (Some(_), _, Some(_)) => bail!("a node serves with --cluster-cert; --tls-cert is for a server's clients"),
        (_, _, Some(cluster)) if node.is_some() => Some(cluster.server.clone()),
        (_, _, Some(_)) => bail!("--cluster-ca is for a cluster's members (space node, space serve --cluster)"),
        (Some(cert), Some(key), None) => Some(space_server::http::tls_config(cert, key)?),
        _ => None,
    };
    if tls.is_none() && !args.listen.ip().is_loopback() && !args.insecure_http {
        bail!(
            "{} is not a loopback address: serve it with --tls-cert and --tls-key, or say --insecure-http \
             (API keys would cross the network in clear text)",
            args.listen
        );
    }
    let preview = args
        .preview_domain
        .as_deref()
        .map(space_server::preview::PreviewDomain::new)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let mut config = args.engine.platform_config(&args.data_dir)?;
    config.database = args.database.clone();
    if let Some(socket) = &args.helper_socket {
        // Before anything else reads a byte from the network, and while
        // this process still has one thread (what confining needs).
        let confined = confine(&args, &config, socket)?;
        tracing::info!(
            uid = nix::unistd::getuid().as_raw(),
            landlock = ?confined.landlock,
            "confined: no capabilities, no_new_privs, seccomp filter"
        );
        // Landlock shows nowhere outside the process: `space doctor` reads
        // what it achieved here.
        let record = serde_json::json!({
            "pid": std::process::id(),
            "landlock": format!("{:?}", confined.landlock).to_lowercase(),
            "missing_paths": confined.missing.len(),
        });
        let path = space_host::datadir::state_dir(&config.data_dir).join(crate::cmd::CONFINED_RECORD);
        std::fs::write(&path, record.to_string()).with_context(|| format!("writing {}", path.display()))?;
    }
    let platform = space_server::start_platform_with_helper(&config, args.helper_socket.as_deref())?;
    if let Some(node) = &node {
        // The sandboxes it creates say which node holds them.
        platform.join_cluster_as(&node.id);
    }
    platform.set_metrics_without_key(args.metrics_without_key);
    let node_token = match (&node, &args.node_token_file) {
        (Some(_), Some(path)) => Some(read_secret_file(path, "node token")?),
        (Some(_), None) => bail!("a node needs --node-token-file"),
        (None, _) => None,
    };
    let key = if node.is_some() {
        String::new() // a node takes only the node token
    } else if args.dev {
        eprintln!(
            "WARNING: development mode: loopback only, one API key in {}. Do not expose this server.",
            platform.data().dev_key_path().display()
        );
        dev_key(&platform.data().dev_key_path())?
    } else {
        let path = args.api_key_file.as_ref().context("without --dev, --api-key-file is required")?;
        let key = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let key = key.trim().to_string();
        if key.len() < 16 {
            bail!("the API key in {} is shorter than 16 characters", path.display());
        }
        key
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        // Handlers go in before the address is announced, so a client that
        // saw it can always stop the server cleanly.
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        platform.start().await.map_err(|e| anyhow::anyhow!(e.message))?;
        let is_node = node.is_some();
        let state = match (node, node_token) {
            (Some(node), Some(token)) => {
                let scheme = if cluster_tls.is_some() { "https" } else { "http" };
                let url = node.advertise.unwrap_or_else(|| format!("{scheme}://{}", args.listen));
                let url = match listener.local_addr() {
                    Ok(addr) if url.ends_with(":0") => format!("{scheme}://{addr}"),
                    _ => url,
                };
                let links = space_server::cluster::Links::new(cluster_tls.as_ref().map(|t| t.client.clone()));
                platform.run_until_shutdown(space_server::cluster::heartbeats(
                    platform.clone(),
                    links.clone(),
                    node.control_plane,
                    token.clone(),
                    node.id,
                    url,
                ));
                space_server::AppState::node(platform, token, links)
            }
            _ => space_server::AppState::new(platform, key),
        };
        let mut state = state;
        state.tls = tls.is_some() && !is_node;
        if let Some(preview) = preview {
            tracing::info!("previews on {{port}}-{{sandbox id}}.{}", preview.as_str());
            state = state.with_preview(preview);
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!("SPACE listening on {scheme}://{}", listener.local_addr()?);
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
            tracing::info!("shutting down");
        };
        let platform = state.platform.clone();
        space_server::http::serve_with(listener, state, tls, shutdown).await?;
        // The background tasks end and the warm sandboxes go (they belong
        // to no one); the others keep running for the next server.
        platform.shutdown().await;
        Ok(())
    })
}

/// Confines `space serve` beside a root helper: it keeps no privilege, may
/// write only what the server itself writes in the data dir (`state/`,
/// `logs/`, `run/uploads/`) and read the rest of it and what a TLS client
/// and resolver read; it starts nothing.
fn confine(args: &ServeArgs, config: &space_server::PlatformConfig, socket: &Path) -> Result<Confined> {
    let user = args.user.as_deref().map(user_ids).transpose()?;
    if user.is_none() && nix::unistd::geteuid().is_root() {
        bail!("beside a helper the server does not run as root: say --user NAME (the helper's --allow-uid)");
    }
    let data = std::fs::canonicalize(&config.data_dir)
        .with_context(|| format!("opening data dir {}", config.data_dir.display()))?;
    // Not opened here: as root, opening would make (and so own) what the
    // helper gives the server's user; the helper has made them by now.
    let read_write = space_host::datadir::server_paths(&data).to_vec();
    if let Some(missing) = read_write.iter().find(|dir| !dir.is_dir()) {
        bail!(
            "{} is missing: start `space helper` (or run `space setup`) first, which makes it for the server's user",
            missing.display()
        );
    }
    let mut read_only: Vec<PathBuf> = [
        "/proc",
        "/sys/fs/cgroup",
        "/sys/fs/btrfs",
        "/sys/devices/system/cpu",
        "/dev/null",
        "/dev/urandom",
        "/etc/ssl",
        "/etc/ca-certificates",
        "/usr/share/ca-certificates",
        "/etc/resolv.conf",
        "/etc/hosts",
        "/etc/nsswitch.conf",
        "/etc/gai.conf",
        "/etc/host.conf",
        "/etc/localtime",
        "/etc/passwd",
        "/etc/group",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    read_only.push(data);
    read_only.extend(socket.parent().map(Path::to_path_buf));
    read_only.extend(
        [
            &args.api_key_file,
            &args.tls_cert,
            &args.tls_key,
            &args.node_token_file,
            &args.cluster_ca,
            &args.cluster_cert,
            &args.cluster_key,
            &args.secrets_key_file,
        ]
        .into_iter()
        .flatten()
        .cloned(),
    );
    // The extra upstream roots the egress gateway trusts, read as it starts.
    read_only.extend(args.engine.egress_trust.iter().cloned());
    let confinement = Confinement { read_write, read_only, user, require_full_landlock: false };
    space_privsep::confine::confine(&confinement).context("confining the server")
}

/// The uid and primary gid of `user`, a name or a uid.
fn user_ids(user: &str) -> Result<(u32, u32)> {
    use nix::unistd::{Uid, User};
    let found = match user.parse::<u32>() {
        Ok(uid) => User::from_uid(Uid::from_raw(uid)),
        Err(_) => User::from_name(user),
    };
    let found = found.with_context(|| format!("looking up user {user}"))?;
    let found = found.with_context(|| format!("no user {user} on this host (space setup makes one)"))?;
    Ok((found.uid.as_raw(), found.gid.as_raw()))
}
