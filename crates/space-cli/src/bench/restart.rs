//! `space bench`'s restart figures: a `space serve` process killed (SIGKILL)
//! over N live sandboxes, and a new one on the same data dir: how soon it
//! answers `GET /v1/health` after it was started, how soon every sandbox is
//! re-adopted (`reconciling` 0), and how soon every one has answered an
//! exec (all asked at once, as soon as the server answers).

use std::io::{BufRead as _, Write as _};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use space_host::datadir::DataDir;
use space_process::{ReapedChild, Reaper};

use crate::cli::BenchArgs;
use crate::client::Client;

/// Clients creating (and later exec'ing) at once.
const CLIENTS: usize = 4;
/// How long the figures may take before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(120);

/// A `space serve` child on a loopback port, and its client.
struct Served {
    child: ReapedChild,
    client: Client,
    spawned: Instant,
    stopped: bool,
}

impl Served {
    /// Sends `signal` and waits for the server to end.
    fn stop(&mut self, signal: nix::sys::signal::Signal) -> Result<()> {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), signal)?;
        self.child.wait();
        self.stopped = true;
        Ok(())
    }
}

impl Drop for Served {
    /// A figure failed: the server goes (its sandboxes, see [`run`]).
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.stop(nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// `space serve` on `data`, with `pools` hot and warm members, pausing
/// sandboxes idle for `idle_pause_s` (0: never).
fn serve(args: &BenchArgs, data: &DataDir, pools: u32, idle_pause_s: u64) -> Result<Served> {
    let pools = pools.to_string();
    let idle = idle_pause_s.to_string();
    // What N idle sandboxes cost is not what their promises add up to.
    let capacity = u32::MAX.to_string();
    let serve_args =
        ["--warm-pool", &pools, "--hot-pool", &pools, "--auto-pause-s", &idle, "--capacity-mib", &capacity];
    let spawned = Instant::now();
    let (child, client) = spawn_serve(args, data, &serve_args, &format!("restart-{pools}"))?;
    Ok(Served { child, client, spawned, stopped: false })
}

/// `space serve --dev` on a loopback port over `data` with `serve_args`,
/// once it listens; it and its client. What it says after that goes to a
/// log named by `log_name` in the temporary directory, for when a figure
/// fails.
pub(super) fn spawn_serve(
    args: &BenchArgs,
    data: &DataDir,
    serve_args: &[&str],
    log_name: &str,
) -> Result<(ReapedChild, Client)> {
    let exe = std::env::current_exe().context("locating the space binary")?;
    let mut command = Command::new(exe);
    command
        .args(["serve", "--dev", "--listen", "127.0.0.1:0"])
        .args(serve_args)
        .arg("--data-dir")
        .arg(data.root())
        .arg("--agent-bin")
        .arg(args.engine.agent_bin()?)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = Reaper::global().spawn(&mut command).context("starting `space serve`")?;
    let stderr = child.child.stderr.take().context("the server's stderr")?;
    let mut lines = std::io::BufReader::new(stderr).lines();
    let url = loop {
        let line = lines.next().context("the server exited before it listened")??;
        if let Some(at) = line.find("listening on ") {
            break line[at + "listening on ".len()..].trim().to_string();
        }
    };
    let log_path = std::env::temp_dir().join(format!("space-bench-{log_name}-{}.log", std::process::id()));
    let mut log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            let _ = writeln!(log, "{line}");
        }
    });
    let key = std::fs::read_to_string(data.dev_key_path()).context("the server's dev key")?;
    Ok((child, Client::new(&url, key.trim())))
}

/// Runs `work` for every item on [`CLIENTS`] threads at once.
fn on_clients<T: Sync>(items: &[T], work: impl Fn(&T) -> Result<()> + Sync) -> Result<()> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    while let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) {
                        work(item)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().map_err(|_| anyhow::anyhow!("a client panicked"))?)
    })
}

/// Twice: with every sandbox kept running (what 100 idle gVisor sandboxes
/// cost is more CPU than two cores have), and with the server's idle pause
/// on, every sandbox paused by it before the kill (how a server runs them
/// by default).
pub fn run(args: &BenchArgs, scratch: &DataDir, n: usize) -> Result<()> {
    let result = measure(args, scratch, n, 0).and_then(|()| measure(args, scratch, n, args.idle_pause_s));
    if result.is_err() {
        // The servers are gone; what they started would outlive the bench.
        destroy_all(args, scratch)?;
    }
    result
}

/// Stops every sandbox started over `scratch` and removes its files.
fn destroy_all(args: &BenchArgs, scratch: &DataDir) -> Result<()> {
    use space_engine::Engine as _;
    let engine = space_engine::gvisor::Gvisor::new(space_engine::gvisor::GvisorConfig {
        runsc: args.engine.runsc.clone(),
        agent_bin: args.engine.agent_bin()?,
        state_dir: scratch.run_dir().join("runsc"),
    });
    let engine = std::sync::Arc::new(engine);
    let runtime = tokio::runtime::Runtime::new()?;
    let destroys: Vec<_> = std::fs::read_dir(scratch.sandboxes_dir())?
        .flatten()
        .map(|entry| {
            let spec = space_engine::SandboxSpec {
                id: entry.file_name().to_string_lossy().into_owned(),
                dir: entry.path(),
                ..space_engine::SandboxSpec::default()
            };
            let engine = engine.clone();
            runtime.spawn(async move {
                if let Err(err) = engine.destroy(&spec).await {
                    eprintln!("bench: destroying {}: {err}", spec.id);
                }
            })
        })
        .collect();
    for destroy in destroys {
        runtime.block_on(destroy)?;
    }
    Ok(())
}

fn measure(args: &BenchArgs, scratch: &DataDir, n: usize, idle_pause_s: u64) -> Result<()> {
    // Its pool members are left on disk by the kill, for the new server
    // to sweep beside the re-adoption.
    let first = serve(args, scratch, 1, idle_pause_s)?;
    let ids = Mutex::new(Vec::with_capacity(n));
    on_clients(&vec![(); n], |()| {
        let accepted =
            first.client.post("/v1/sandboxes", &serde_json::json!({"template": args.template, "memory_mib": 256}))?;
        let operation = first.client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
        if operation["state"] != "succeeded" {
            bail!("a create failed: {}", operation["error"]);
        }
        ids.lock().unwrap().push(accepted["sandbox"]["id"].as_str().context("no sandbox id")?.to_string());
        Ok(())
    })?;
    let ids = ids.into_inner().unwrap();
    if idle_pause_s > 0 {
        let deadline = Instant::now() + PATIENCE;
        while crate::bench::density::count_auto_paused(&first.client)? < n {
            if Instant::now() > deadline {
                bail!("the server did not pause the idle sandboxes within {PATIENCE:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let idle_cost = if idle_pause_s == 0 { Some(idle_cpu(&ids)?) } else { None };
    // Killed: its sandboxes live on, as after a crash.
    let mut first = first;
    first.stop(nix::sys::signal::Signal::SIGKILL)?;

    let mut second = serve(args, scratch, 0, idle_pause_s)?;
    let client = &second.client;
    let deadline = second.spawned + PATIENCE;
    let listening = loop {
        if client.get("/v1/health").is_ok() {
            break second.spawned.elapsed();
        }
        if Instant::now() > deadline {
            bail!("the restarted server did not answer within {PATIENCE:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let usable = Mutex::new(Duration::ZERO);
    let exec_all = std::thread::scope(|scope| {
        let execs = scope.spawn(|| {
            on_clients(&ids, |id| {
                let answer =
                    client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": ["true"]}))?;
                if answer["result"]["exit_code"] != 0 {
                    bail!("{id} did not answer `true` after the restart: {answer}");
                }
                let mut usable = usable.lock().unwrap();
                *usable = (*usable).max(second.spawned.elapsed());
                Ok(())
            })
        });
        let readopted = loop {
            let health = client.get("/v1/health")?;
            if health["reconciling"] == 0 {
                break second.spawned.elapsed();
            }
            if Instant::now() > deadline {
                bail!("{} sandboxes were still being re-adopted after {PATIENCE:?}", health["reconciling"]);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        execs.join().map_err(|_| anyhow::anyhow!("the exec clients panicked"))??;
        Ok(readopted)
    });
    let readopted = exec_all?;
    on_clients(&ids, |id| {
        let deleted = client.delete(&format!("/v1/sandboxes/{id}"))?;
        client.wait_operation(deleted["operation"]["id"].as_str().unwrap_or_default())?;
        Ok(())
    })?;
    second.stop(nix::sys::signal::Signal::SIGTERM)?;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let how = if idle_pause_s > 0 { "idle-paused" } else { "running" };
    if let Some((awake, dozing)) = idle_cost {
        println!("{:<44} {:>9.1} % of a core", format!("{n} idle running sandboxes, awake"), awake);
        println!("{:<44} {:>9.1} % of a core", format!("{n} idle running sandboxes, dozing"), dozing);
    }
    println!("{:<44} {:>9.1} ms", format!("restart over {n} {how} sandboxes: answers"), ms(listening));
    println!("{:<44} {:>9.1} ms", format!("restart over {n} {how}: all re-adopted"), ms(readopted));
    println!("{:<44} {:>9.1} ms", format!("restart over {n} {how}: all answered exec"), ms(*usable.lock().unwrap()));
    Ok(())
}

/// How long idle sandboxes' CPU is counted for.
const CPU_WINDOW: Duration = Duration::from_secs(10);

/// The CPU `ids` (idle, running) use together, in % of a core: woken by
/// hand (timers as usual) and then dozing, as the server keeps them.
fn idle_cpu(ids: &[String]) -> Result<(f64, f64)> {
    use space_engine::gvisor::{cgroup_path, set_timer_slack, IDLE_TIMER_SLACK_NS};
    let used = || -> u64 {
        let cpu = |id: &String| space_engine::cgroup_use(cgroup_path(id).strip_prefix("/").ok()?).map(|u| u.cpu_usec);
        ids.iter().filter_map(cpu).sum()
    };
    let share = || {
        let (before, since) = (used(), Instant::now());
        std::thread::sleep(CPU_WINDOW);
        used().saturating_sub(before) as f64 / since.elapsed().as_micros() as f64 * 100.0
    };
    // The server dozes them 2 s after their last request.
    std::thread::sleep(Duration::from_secs(3));
    let slack_all = |ns: Option<u64>| ids.iter().try_for_each(|id| set_timer_slack(id, ns).map(|_| ()));
    slack_all(None)?;
    let awake = share();
    slack_all(Some(IDLE_TIMER_SLACK_NS))?;
    Ok((awake, share()))
}
