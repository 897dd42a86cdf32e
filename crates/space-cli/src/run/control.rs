//! `space serve --cluster`: a cluster's control plane.

use anyhow::{bail, Context, Result};

use super::{init_logging, read_secret_file};
use crate::cli::ServeArgs;

/// `space serve --cluster`: a control plane over PostgreSQL and its nodes.
pub(crate) fn control_plane(args: ServeArgs) -> Result<()> {
    init_logging(args.log_format);
    let url = args.database.as_deref().context("--cluster needs --database")?;
    let token =
        read_secret_file(args.node_token_file.as_deref().context("--cluster needs --node-token-file")?, "node token")?;
    let key = match &args.api_key_file {
        Some(path) => read_secret_file(path, "API key")?,
        None => bail!("a control plane needs --api-key-file"),
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(space_server::http::tls_config(cert, key)?),
        _ => None,
    };
    if tls.is_none() && !args.listen.ip().is_loopback() && !args.insecure_http {
        bail!(
            "{} is not a loopback address: serve it with --tls-cert and --tls-key, or say --insecure-http",
            args.listen
        );
    }
    let keyring = match &args.secrets_key_file {
        // Made here, each replica would seal with a key of its own.
        Some(path) if !path.exists() => {
            bail!("{} does not exist: make it once (openssl rand -hex 32) and give every replica it", path.display())
        }
        Some(path) => Some(
            space_server::secrets::Keyring::load_or_create(path)
                .with_context(|| format!("reading the secrets key {}", path.display()))?,
        ),
        None => None,
    };
    let cluster_tls = args.cluster_tls()?;
    let links = space_control::Links::new(cluster_tls.as_ref().map(|t| t.client.clone()));
    let store = space_server::store::Store::connect(url)?;
    let cp = std::sync::Arc::new(space_control::ControlPlane::new(space_control::Config {
        store,
        api_key: key,
        node_token: token,
        keyring,
        links,
        // The contract a node serves, served the same by the control plane.
        openapi: space_server::api::openapi::document_json(),
    }));
    if let Some(domain) = &args.preview_domain {
        // Its nodes serve the same domain (their --preview-domain).
        cp.serve_previews(space_server::preview::PreviewDomain::new(domain).map_err(anyhow::Error::msg)?);
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        cp.start();
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!("SPACE control plane listening on {scheme}://{}", listener.local_addr()?);
        if let (Some(address), Some(cluster_tls)) = (args.cluster_listen, &cluster_tls) {
            let internal =
                tokio::net::TcpListener::bind(address).await.with_context(|| format!("binding {address}"))?;
            tracing::info!("taking nodes' heartbeats on https://{}", internal.local_addr()?);
            let router = space_control::internal_router(cp.clone());
            tokio::spawn(space_server::http::serve_router(
                internal,
                router,
                Some(cluster_tls.server.clone()),
                std::future::pending(),
            ));
        }
        let shutdown = async move {
            term.recv().await;
        };
        space_server::http::serve_router(listener, space_control::router(cp.clone()), tls, shutdown).await?;
        // Its loops end before the process does (their claims lapse for
        // the other replicas to take up).
        cp.shutdown().await;
        Ok(())
    })
}
