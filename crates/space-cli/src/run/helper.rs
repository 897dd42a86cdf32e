//! `space helper`: the root helper. It does the gVisor engine's root work
//! (runsc, roots and quotas, the bundle, the agent's socket, the freezer)
//! for one unprivileged uid on a Unix socket; `space serve --helper-socket`
//! asks it (decision 024).

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
    let config = GvisorConfig {
        runsc: args.runsc.clone(),
        agent_bin: find_agent_bin(args.agent_bin.as_deref())?,
        state_dir: data.run_dir().join("runsc"),
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let serving = space_engine::helper::serve_gvisor(config, &args.socket, args.allow_uid);
        tracing::info!(socket = %args.socket.display(), uid = args.allow_uid, "SPACE helper starting");
        tokio::select! {
            served = serving => served.with_context(|| format!("serving {}", args.socket.display())),
            _ = term.recv() => Ok(()),
            _ = interrupt.recv() => Ok(()),
        }
    })
}
