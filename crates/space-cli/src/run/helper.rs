//! `space helper`: the root helper. It does the engines' root work (runsc,
//! roots and quotas, the bundle, the agent's socket, the freezer; jailed
//! Firecracker VMMs, their drives and snapshots) and templates' for one
//! unprivileged uid on a Unix socket; `space serve --helper-socket` asks
//! it (decisions 024, 026).

use anyhow::{Context, Result};
use space_engine::gvisor::GvisorConfig;

use super::init_logging;
use crate::cli::{find_agent_bin, HelperArgs};

pub(crate) fn helper(args: HelperArgs) -> Result<()> {
    init_logging(args.log_format);
    anyhow::ensure!(nix::unistd::geteuid().is_root(), "space helper does the engine's root work: run it as root");
    // runsc's sandbox processes outlive the command that started them.
    space_process::become_subreaper().context("becoming a subreaper")?;
    let data = space_host::datadir::DataDir::open(&args.data_dir)?;
    // Sandboxes' disk_mib is a btrfs quota on their root: the server beside
    // it may not turn quotas on itself.
    space_host::btrfs::enable_quotas(data.root())?;
    // What the server writes becomes its user's; the rest stays root's.
    let gid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(args.allow_uid))
        .ok()
        .flatten()
        .map_or(args.allow_uid, |user| user.gid.as_raw());
    let handed = data.hand_over(args.allow_uid, gid)?;
    if handed > 0 {
        tracing::info!(entries = handed, uid = args.allow_uid, "gave the server's paths in the data dir to its user");
    }
    let config = GvisorConfig {
        runsc: args.runsc.clone(),
        agent_bin: find_agent_bin(args.agent_bin.as_deref())?,
        state_dir: data.run_dir().join("runsc"),
    };
    // This very binary parses image archives, in a confined child of its own.
    let importer = std::env::current_exe().context("finding this binary, the importer")?;
    // Beside gVisor, the microVMs of a host that runs them.
    let firecracker = space_engine::firecracker::find_firecracker(args.firecracker_bin.as_deref())
        .map(|binary| space_server::firecracker_config(&data, binary));
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let volumes = args.shared_volumes.as_deref();
        let serving =
            space_engine::helper::serve_helper(config, firecracker, volumes, &importer, &args.socket, args.allow_uid);
        tracing::info!(socket = %args.socket.display(), uid = args.allow_uid, "SPACE helper starting");
        tokio::select! {
            served = serving => served.with_context(|| format!("serving {}", args.socket.display())),
            _ = term.recv() => Ok(()),
            _ = interrupt.recv() => Ok(()),
        }
    })
}
