//! `space bench`: create-to-ready and exec round-trip latency through the
//! real API, side by side with the raw engine floor measured in the same
//! run (`runsc run` to the agent's hello; `runsc exec true`).

mod cluster;
mod density;
mod previews;
mod pull;
mod restart;
mod split;
mod volumes;

use std::time::{Duration, Instant};

use serde_json::Value;

use anyhow::{bail, Context, Result};
use space_engine::gvisor::{Gvisor, GvisorConfig};
use space_engine::{Engine, SandboxSpec};
use space_host::datadir::DataDir;
use space_process::Reaper;
use space_proto::{FrameKind, Hello};
use tokio::io::AsyncReadExt;

use crate::cli::BenchArgs;
use crate::client::Client;

/// Times `posix_spawn` + `waitpid` of `true` inside the sandbox, in ms.
const SPAWN_PROBE: &str = "import os, time\nfor _ in range(10):\n    t = time.perf_counter()\n    os.waitpid(os.posix_spawn('/bin/true', ['true'], {}), 0)\n    print((time.perf_counter() - t) * 1000)";

#[derive(Default)]
pub(crate) struct Samples(pub(crate) Vec<Duration>);

/// Cold creates per run beside the measured one, for the tail figure.
const TAIL_CREATES: usize = 2;

/// Deletes a sandbox and waits until it is gone.
fn delete_and_wait(client: &Client, id: &str) -> Result<()> {
    let deleted = client.delete(&format!("/v1/sandboxes/{id}"))?;
    client.wait_operation(deleted["operation"]["id"].as_str().unwrap_or_default())?;
    Ok(())
}

impl Samples {
    pub(crate) fn percentile(&self, p: f64) -> f64 {
        let mut ms: Vec<f64> = self.0.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        ms.sort_by(|a, b| a.total_cmp(b));
        if ms.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * (ms.len() as f64 - 1.0)).round() as usize;
        ms[rank.min(ms.len() - 1)]
    }
}

/// Bytes per second, in MB/s (10^6).
struct Throughput {
    api_stream: f64,
    local_pipe: f64,
    guest_pipe: f64,
    upload: f64,
    download: f64,
}

const STREAM_BYTES: u64 = 200 << 20;
const FILE_BYTES: usize = 64 << 20;
const PRODUCER: &str = "head -c 209715200 /dev/zero | tr '\\0' x";

fn mb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / 1e6 / elapsed.as_secs_f64()
}

/// Output streaming through the API against a local pipe producing the
/// same bytes, and file transfer rates.
fn measure_throughput(client: &Client, id: &str) -> Result<Throughput> {
    // The host's own pipe: the same producer, read through a pipe.
    let started = Instant::now();
    let local = Reaper::global().output(std::process::Command::new("sh").args(["-c", PRODUCER]))?;
    let local_pipe = mb_per_s(local.stdout.len() as u64, started.elapsed());

    let started = Instant::now();
    let created = client.post(&format!("/v1/sandboxes/{id}/commands"), &serde_json::json!({"cmd": PRODUCER}))?;
    let output = created["command"]["attach"]["output"].as_str().unwrap_or_default().to_string();
    let received = client.count_output(&output)?;
    let api_stream = mb_per_s(received, started.elapsed());
    if received != STREAM_BYTES {
        bail!("the stream delivered {received} of {STREAM_BYTES} bytes");
    }
    // The guest's own floor: the producer through one more pipe inside it.
    let probe = format!(
        "import subprocess, time\nt = time.perf_counter()\nsubprocess.run(['sh', '-c', {:?} + ' | cat > /dev/null'])\nprint({STREAM_BYTES} / 1e6 / (time.perf_counter() - t))",
        PRODUCER
    );
    let inside =
        client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": ["python3", "-c", probe]}))?;
    let guest_pipe = inside["stdout"].as_str().unwrap_or("").trim().parse::<f64>().unwrap_or(f64::NAN);

    let payload: Vec<u8> = (0..FILE_BYTES).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let local_file = std::env::temp_dir().join(format!("space-bench-{}", std::process::id()));
    std::fs::write(&local_file, &payload)?;
    let started = Instant::now();
    client.upload(id, "/root/bench.bin", "0644", std::fs::File::open(&local_file)?)?;
    let upload = mb_per_s(FILE_BYTES as u64, started.elapsed());
    let started = Instant::now();
    let mut back = Vec::with_capacity(FILE_BYTES);
    client.download(id, "/root/bench.bin", &mut back)?;
    let download = mb_per_s(back.len() as u64, started.elapsed());
    let _ = std::fs::remove_file(&local_file);
    if back != payload {
        bail!("the downloaded file differs from the uploaded one");
    }
    Ok(Throughput { api_stream, local_pipe, guest_pipe, upload, download })
}

/// The fixed name the egress figures' upstream (this process) answers to.
const EGRESS_HOST: &str = "upstream.bench.space.test";
const EGRESS_BYTES: u64 = 1 << 30;

struct Egress {
    through: f64,
    direct: f64,
    request_through_ms: f64,
    request_direct_ms: f64,
    server_growth_mib: f64,
    server_peak_mib: f64,
}

/// An HTTP upstream on loopback: `/big` is [`EGRESS_BYTES`], anything else
/// a few bytes. Returns its port.
fn egress_upstream() -> Result<u16> {
    use std::io::{BufRead, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(match stream.try_clone() {
                    Ok(s) => s,
                    Err(_) => return,
                });
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                }
                let mut stream = stream;
                let size = if line.contains("/big") { EGRESS_BYTES } else { 2 };
                let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n");
                let chunk = vec![b'e'; 1 << 20];
                let mut left = size;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if stream.write_all(&chunk[..n]).is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            });
        }
    });
    Ok(port)
}

/// This process's resident memory, in bytes.
fn own_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// Egress against the same upstream reached directly from the host: a
/// 1 GiB download and a small request's round trip (connect included).
fn measure_egress(client: &Client, id: &str) -> Result<Egress> {
    use std::io::{Read, Write};
    let port = egress_upstream()?;
    client.put(
        &format!("/v1/sandboxes/{id}/network"),
        &serde_json::json!({"egress": "allowlist", "allow": [format!("{EGRESS_HOST}:{port}")]}),
    )?;
    let fetch = |path: &str| -> Result<u64> {
        let mut socket = std::net::TcpStream::connect(("127.0.0.1", port))?;
        write!(socket, "GET {path} HTTP/1.1\r\nHost: {EGRESS_HOST}\r\n\r\n")?;
        let mut body = Vec::new();
        socket.read_to_end(&mut body)?;
        Ok(body.len() as u64)
    };
    let started = Instant::now();
    fetch("/big")?;
    let direct = mb_per_s(EGRESS_BYTES, started.elapsed());
    let mut direct_requests = Samples(vec![]);
    for _ in 0..20 {
        let started = Instant::now();
        fetch("/small")?;
        direct_requests.0.push(started.elapsed());
    }
    let probe = format!(
        "import time, urllib.request\nurl = 'http://{EGRESS_HOST}:{port}'\nt = time.perf_counter()\nr = urllib.request.urlopen(url + '/big')\nn = 0\nwhile True:\n    b = r.read(1 << 20)\n    if not b:\n        break\n    n += len(b)\nprint(n / 1e6 / (time.perf_counter() - t))\nfor _ in range(20):\n    t = time.perf_counter()\n    urllib.request.urlopen(url + '/small').read()\n    print((time.perf_counter() - t) * 1000)"
    );
    let baseline = own_rss();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(own_rss(), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let answer =
        client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": ["python3", "-c", probe]}));
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = sampler.join();
    let answer = answer?;
    let mut lines = answer["stdout"].as_str().unwrap_or("").lines().map(|l| l.trim().parse::<f64>());
    let through = match lines.next() {
        Some(Ok(rate)) => rate,
        _ => bail!("the egress probe failed: {answer}"),
    };
    let mut requests: Vec<f64> = lines.filter_map(|l| l.ok()).collect();
    requests.sort_by(|a, b| a.total_cmp(b));
    client.put(&format!("/v1/sandboxes/{id}/network"), &serde_json::json!({"egress": "none"}))?;
    Ok(Egress {
        through,
        direct,
        request_through_ms: requests.get(requests.len() / 2).copied().unwrap_or(f64::NAN),
        request_direct_ms: direct_requests.percentile(50.0),
        server_growth_mib: peak.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(baseline) as f64
            / (1u64 << 20) as f64,
        server_peak_mib: peak.load(std::sync::atomic::Ordering::Relaxed) as f64 / (1u64 << 20) as f64,
    })
}

/// Calls a lifecycle action and waits for its operation; returns how long.
/// Create -> ready through the API (accepted -> operation succeeded),
/// timed into `samples`; the new sandbox's id.
pub(crate) fn timed_create(client: &Client, template: &str, samples: &mut Samples) -> Result<String> {
    timed_create_op(client, template, samples).map(|(id, _)| id)
}

/// [`timed_create`], with the create's operation as it ended.
fn timed_create_op(client: &Client, template: &str, samples: &mut Samples) -> Result<(String, serde_json::Value)> {
    let started = Instant::now();
    let accepted = client.post("/v1/sandboxes", &serde_json::json!({"template": template}))?;
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("create failed: {}", operation["error"]);
    }
    samples.0.push(started.elapsed());
    Ok((accepted["sandbox"]["id"].as_str().unwrap_or_default().to_string(), operation))
}

/// Each step's durations over many operations, in the order first seen.
#[derive(Default)]
struct StepSamples(Vec<(String, Samples)>);

impl StepSamples {
    /// Adds the steps an operation timed (`progress.timings`).
    fn add(&mut self, operation: &serde_json::Value) {
        for timing in operation["progress"]["timings"].as_array().into_iter().flatten() {
            let (Some(step), Some(ms)) = (timing["step"].as_str(), timing["ms"].as_f64()) else { continue };
            let at = match self.0.iter().position(|(name, _)| name == step) {
                Some(at) => at,
                None => {
                    self.0.push((step.to_string(), Samples(vec![])));
                    self.0.len() - 1
                }
            };
            self.0[at].1 .0.push(Duration::from_secs_f64(ms / 1000.0));
        }
    }
}

/// Waits until `platform`'s pools hold `members`, `hot` of them running.
fn pools_settled(platform: &space_server::Platform, members: usize, hot: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while (platform.warm().count(), platform.warm().hot_count()) != (members, hot) {
        if Instant::now() > deadline {
            bail!("the pools did not refill within a minute");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// What the hot members cost while they wait: % of one core each.
fn hot_idle_cpu(platform: &space_server::Platform) -> f64 {
    const OVER: Duration = Duration::from_secs(5);
    let (members, before) = platform.warm().hot_cpu();
    std::thread::sleep(OVER);
    let (_, after) = platform.warm().hot_cpu();
    after.saturating_sub(before).as_secs_f64() / OVER.as_secs_f64() / members.max(1) as f64 * 100.0
}

/// One `exec true` round trip through the API, timed into `samples`.
pub(crate) fn timed_true(client: &Client, id: &str, samples: &mut Samples) -> Result<()> {
    let started = Instant::now();
    let answer = client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": ["true"]}))?;
    samples.0.push(started.elapsed());
    if answer["result"]["exit_code"] != 0 {
        bail!("`true` failed: {answer}");
    }
    Ok(())
}

/// A client following the event stream, as a console would, for the
/// rest of the run; how many events it has seen.
fn follow_events(client: &Client) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
    let follower = Client::new(client.base(), client.key());
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = seen.clone();
    std::thread::spawn(move || {
        let _ = follower.events("", None, true, |_| {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok::<(), crate::client::ClientError>(())
        });
    });
    seen
}

/// The exec round trip with request metrics, request logs and events on,
/// and with them off, alternating in one sandbox (with an event stream
/// followed throughout).
fn measure_observability(
    client: &Client,
    platform: &space_server::Platform,
    id: &str,
    rounds: usize,
    seen: &std::sync::atomic::AtomicU64,
) -> Result<(Samples, Samples)> {
    let (mut on, mut off) = (Samples(vec![]), Samples(vec![]));
    let before = seen.load(std::sync::atomic::Ordering::Relaxed);
    for round in 0..rounds * 2 {
        let observing = round % 2 == 0;
        platform.observe(observing);
        timed_true(client, id, if observing { &mut on } else { &mut off })?;
    }
    platform.observe(true);
    // The last `on` round's events may still be on their way.
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.load(std::sync::atomic::Ordering::Relaxed) == before {
        if Instant::now() > deadline {
            bail!("the event stream carried nothing while events were on");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok((on, off))
}

/// `commands.run("true")` as the e2b SDK sends it (`/bin/bash -l -c true`
/// on envd's `Start` stream, read to its end-of-stream frame), each next
/// to SPACE's own exec of the same argv.
fn measure_e2b(client: &Client, id: &str, runs: usize, e2b: &mut Samples, own: &mut Samples) -> Result<()> {
    let json = [("Content-Type", "application/json"), ("X-API-KEY", client.key())];
    let (status, body) = client.post_bytes(&format!("/e2b/v2/sandboxes/{id}/connect"), &json, b"{}")?;
    if status / 100 != 2 {
        bail!("E2B connect answered {status}: {}", String::from_utf8_lossy(&body));
    }
    let connected: serde_json::Value = serde_json::from_slice(&body)?;
    let token = connected["envdAccessToken"].as_str().unwrap_or_default().to_string();
    let argv = ["/bin/bash", "-l", "-c", "true"];
    let message = serde_json::json!({"process": {"cmd": argv[0], "args": &argv[1..]}, "stdin": false}).to_string();
    let mut envelope = vec![0u8];
    envelope.extend_from_slice(&(message.len() as u32).to_be_bytes());
    envelope.extend_from_slice(message.as_bytes());
    let headers = [
        ("Content-Type", "application/connect+json"),
        ("Connect-Protocol-Version", "1"),
        ("Connect-Timeout-Ms", "60000"),
        ("E2b-Sandbox-Id", id),
        ("X-Access-Token", token.as_str()),
    ];
    for _ in 0..runs {
        let started = Instant::now();
        let (status, answer) = client.post_bytes("/e2b/envd/process.Process/Start", &headers, &envelope)?;
        e2b.0.push(started.elapsed());
        if status != 200 || !String::from_utf8_lossy(&answer).contains("exit status 0") {
            bail!("E2B Start answered {status}: {}", String::from_utf8_lossy(&answer));
        }
        let started = Instant::now();
        let answer = client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": argv}))?;
        own.0.push(started.elapsed());
        if answer["result"]["exit_code"] != 0 {
            bail!("`bash -l -c true` failed: {answer}");
        }
    }
    Ok(())
}

fn timed_lifecycle(client: &Client, id: &str, action: &str) -> Result<Duration> {
    let started = Instant::now();
    let accepted = client.post(&format!("/v1/sandboxes/{id}/{action}"), &serde_json::json!({}))?;
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("{action} failed: {}", operation["error"]);
    }
    Ok(started.elapsed())
}

/// Bytes of the regular files under `dir`.
fn dir_size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_size(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let shared = DataDir::open(&args.data_dir)?;
    if let Some(n) = args.density {
        let scratch = shared.scratch(&format!("density-{}", std::process::id()), &[&args.template])?;
        let result = crate::bench::density::run(&args, &scratch, n);
        space_host::btrfs::remove_tree(scratch.root())?;
        return result;
    }
    if args.cluster {
        let node = shared.scratch(&format!("bench-node-{}", std::process::id()), &[&args.template])?;
        let tls_node = shared.scratch(&format!("bench-tls-node-{}", std::process::id()), &[&args.template])?;
        let single = shared.scratch(&format!("bench-single-{}", std::process::id()), &[&args.template])?;
        let result = crate::bench::cluster::run(&args, &node, &tls_node, &single);
        for data in [&node, &tls_node, &single] {
            space_host::btrfs::remove_tree(data.root())?;
        }
        return result;
    }
    if args.only_split {
        return split_figures(&args, &shared);
    }
    if args.only_pull {
        let cold = shared.scratch(&format!("bench-pull-{}", std::process::id()), &[])?;
        let cached = shared.scratch(&format!("bench-pull-cached-{}", std::process::id()), &[&args.template])?;
        let result = crate::bench::pull::run(&args, &cold, &cached);
        for data in [&cold, &cached] {
            space_host::btrfs::remove_tree(data.root())?;
        }
        return result;
    }
    if args.only_volumes {
        let data = shared.scratch(&format!("bench-volumes-{}", std::process::id()), &[&args.template])?;
        let result = crate::bench::volumes::run(&args, &data);
        space_host::btrfs::remove_tree(data.root())?;
        return result;
    }
    if args.only_previews {
        let data = shared.scratch(&format!("bench-previews-{}", std::process::id()), &[&args.template])?;
        let result = previews::run(&args, &data);
        space_host::btrfs::remove_tree(data.root())?;
        return result;
    }
    if args.only_restart {
        let restart = shared.scratch(&format!("bench-restart-{}", std::process::id()), &[&args.template])?;
        let result = crate::bench::restart::run(&args, &restart, args.restart_sandboxes);
        space_host::btrfs::remove_tree(restart.root())?;
        return result;
    }
    // Code contexts need the code-interpreter template, when it was built.
    let interpreter = space_host::template::CODE_INTERPRETER_TEMPLATE;
    let mut templates = vec![args.template.as_str()];
    if shared.template(interpreter).is_some() && args.template != interpreter {
        templates.push(interpreter);
    }
    let scratch = shared.scratch(&format!("bench-{}", std::process::id()), &templates)?;
    let warm_scratch = shared.scratch(&format!("bench-warm-{}", std::process::id()), &[&args.template])?;
    let hot_scratch = shared.scratch(&format!("bench-hot-{}", std::process::id()), &[&args.template])?;
    let result = bench(&args, &scratch, &warm_scratch, &hot_scratch);
    let cleanup = [&scratch, &warm_scratch, &hot_scratch]
        .into_iter()
        .try_for_each(|data| space_host::btrfs::remove_tree(data.root()));
    result?;
    cleanup?;
    if args.restart_sandboxes > 0 {
        let restart = shared.scratch(&format!("bench-restart-{}", std::process::id()), &[&args.template])?;
        let result = crate::bench::restart::run(&args, &restart, args.restart_sandboxes);
        space_host::btrfs::remove_tree(restart.root())?;
        result?;
    }
    if !args.skip_split {
        split_figures(&args, &shared)?;
    }
    Ok(())
}

/// The privilege split's figures, on two fresh scratch data dirs.
fn split_figures(args: &BenchArgs, shared: &DataDir) -> Result<()> {
    let one = shared.scratch(&format!("bench-one-{}", std::process::id()), &[&args.template])?;
    let split = shared.scratch(&format!("bench-split-{}", std::process::id()), &[&args.template])?;
    let result = crate::bench::split::run(args, &one, &split);
    for data in [&one, &split] {
        space_host::btrfs::remove_tree(data.root())?;
    }
    result
}

/// An in-process server on a loopback port with `config`.
pub(crate) fn start_server(
    runtime: &tokio::runtime::Runtime,
    config: space_server::PlatformConfig,
) -> Result<(Client, std::sync::Arc<space_server::Platform>)> {
    let platform = space_server::start_platform(&config)?;
    runtime.block_on(platform.start()).map_err(|e| anyhow::anyhow!(e.message))?;
    let mut key_bytes = [0u8; 16];
    getrandom::getrandom(&mut key_bytes)?;
    let key: String = key_bytes.iter().map(|b| format!("{b:02x}")).collect();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}", listener.local_addr()?);
    let preview = space_server::preview::PreviewDomain::new(previews::DOMAIN).map_err(anyhow::Error::msg)?;
    let state = space_server::AppState::new(platform.clone(), key.clone()).with_preview(preview);
    runtime.spawn(space_server::serve(listener, state, std::future::pending()));
    Ok((Client::new(&url, &key), platform))
}

fn bench(args: &BenchArgs, scratch: &DataDir, warm_scratch: &DataDir, hot_scratch: &DataDir) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    // Three servers side by side: every create on the first is a cold
    // start, the second hands out members of a one-sandbox warm pool, the
    // third a hot member (running) with one warm member behind it.
    let config = |data: &DataDir, warm_pool, hot_pool| -> Result<space_server::PlatformConfig> {
        let mut config = args.engine.platform_config(data.root())?;
        (config.warm_pool, config.hot_pool) = (warm_pool, hot_pool);
        // The egress figures' upstream is this process, on loopback.
        config.egress = space_server::egress::EgressSettings::parse(
            &[format!("{EGRESS_HOST}=127.0.0.1")],
            &["127.0.0.1/32".to_string()],
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        // Every figure here is of a sandbox in use: none is paused for idleness.
        config.auto_pause_s = 0;
        Ok(config)
    };
    let (client, cold_platform) = start_server(&runtime, config(scratch, 0, 0)?)?;
    let (warm_client, warm_platform) = start_server(&runtime, config(warm_scratch, 1, 0)?)?;
    let (hot_client, hot_platform) = start_server(&runtime, config(hot_scratch, 1, 1)?)?;

    let raw_engine = Gvisor::new(GvisorConfig {
        runsc: args.engine.runsc.clone(),
        agent_bin: args.engine.agent_bin()?,
        state_dir: scratch.run_dir().join("runsc-raw"),
    });
    let template = scratch.template(&args.template).context("the template vanished")?;

    let (mut create, mut exec, mut raw_create, mut raw_exec, mut in_guest) =
        (Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]));
    let (mut pause, mut resume, mut raw_pause, mut raw_resume, mut suspend, mut restore) =
        (Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]));
    let mut snapshot_bytes: Vec<u64> = Vec::new();
    let (mut warm_create, mut hot_create) = (Samples(vec![]), Samples(vec![]));
    let mut cold_steps = StepSamples::default();
    let mut tail_create = Samples(vec![]);
    let (mut e2b_run, mut bash_exec) = (Samples(vec![]), Samples(vec![]));
    let mut idle_pss: Vec<u64> = Vec::new();
    let (mut observed, mut unobserved) = (Samples(vec![]), Samples(vec![]));
    let events_seen = follow_events(&client);
    let mut throughput: Option<Throughput> = None;
    let mut previews: Option<Vec<String>> = None;
    let mut egress: Option<Egress> = None;
    eprintln!(
        "bench: {} sandboxes each side, interleaved; {} API execs and {} raw execs per sandbox",
        args.runs, args.execs, args.raw_execs
    );
    for i in 0..args.runs {
        // Ours: the whole API path, create accepted -> operation succeeded.
        let (id, operation) = timed_create_op(&client, &args.template, &mut create)?;
        cold_steps.add(&operation);
        for _ in 0..args.execs {
            timed_true(&client, &id, &mut exec)?;
        }
        measure_e2b(&client, &id, args.execs, &mut e2b_run, &mut bash_exec)?;
        // The floor inside the sandbox: how long the guest kernel itself
        // takes to start and reap `true` (needs python3 in the template).
        let probe = client
            .post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": ["python3", "-c", SPAWN_PROBE]}));
        if let Ok(answer) = probe {
            for line in answer["stdout"].as_str().unwrap_or("").lines() {
                if let Ok(ms) = line.trim().parse::<f64>() {
                    in_guest.0.push(Duration::from_secs_f64(ms / 1000.0));
                }
            }
        }
        let (on, off) = measure_observability(&client, &cold_platform, &id, args.execs, &events_seen)?;
        observed.0.extend(on.0);
        unobserved.0.extend(off.0);
        if i == 0 {
            throughput = Some(measure_throughput(&client, &id)?);
            previews = Some(previews::measure(&client, &id, args.execs.max(20))?);
            egress = Some(measure_egress(&client, &id)?);
        }
        if let Some(&pss) = crate::bench::density::pss_by_sandbox(std::slice::from_ref(&id)).get(&id) {
            idle_pss.push(pss);
        }
        // Lifecycle through the API: each figure is call accepted -> operation succeeded.
        pause.0.push(timed_lifecycle(&client, &id, "pause")?);
        resume.0.push(timed_lifecycle(&client, &id, "resume")?);
        suspend.0.push(timed_lifecycle(&client, &id, "suspend")?);
        snapshot_bytes.push(dir_size(&scratch.sandbox_dir(&id).join("snapshot")));
        restore.0.push(timed_lifecycle(&client, &id, "resume")?);
        delete_and_wait(&client, &id)?;
        // More cold creates for the tail: a p95 of ten is their maximum.
        for _ in 0..TAIL_CREATES {
            let (id, operation) = timed_create_op(&client, &args.template, &mut tail_create)?;
            cold_steps.add(&operation);
            delete_and_wait(&client, &id)?;
        }

        // Warm and hot: wait until the pools have refilled, then time a create.
        pools_settled(&warm_platform, 1, 0)?;
        let warm_id = timed_create(&warm_client, &args.template, &mut warm_create)?;
        delete_and_wait(&warm_client, &warm_id)?;
        pools_settled(&hot_platform, 2, 1)?;
        let hot_id = timed_create(&hot_client, &args.template, &mut hot_create)?;
        delete_and_wait(&hot_client, &hot_id)?;

        // The floor: runsc alone, from spawn to the agent's first frame.
        // A canonical id in its own directory: the engine refuses any other.
        let id = space_server::ids::new_id("sbx");
        let spec = SandboxSpec {
            id: id.clone(),
            dir: scratch.sandbox_dir(&id),
            template_rootfs: template.rootfs(),
            hostname: "raw".into(),
            vcpus: 1,
            memory_mib: 512,
            disk_mib: 2048,
            env: Default::default(),
            workdir: None,
            user: None,
            engine: None,
            trust_pem: None,
            volumes: Vec::new(),
        };
        let boot = runtime.block_on(async {
            let (mut socket, elapsed) = raw_engine.boot(&spec).await?;
            let mut header = [0u8; space_proto::HEADER_LEN];
            socket.read_exact(&mut header).await?;
            let header = space_proto::decode_header(&header)?;
            let mut payload = vec![0u8; header.len];
            socket.read_exact(&mut payload).await?;
            let hello: Hello = space_proto::Frame::new(header.stream, header.kind, payload).expect(FrameKind::Hello)?;
            anyhow::Ok((elapsed, hello, socket))
        });
        let (elapsed, _hello, socket) = boot?;
        raw_create.0.push(elapsed);
        for _ in 0..args.raw_execs {
            let started = Instant::now();
            let output = Reaper::global().output(raw_engine.runsc().args(["exec", &spec.id, "true"]))?;
            raw_exec.0.push(started.elapsed());
            if !output.status.success() {
                bail!("runsc exec failed: {}", String::from_utf8_lossy(&output.stderr));
            }
        }
        for (action, samples) in [("pause", &mut raw_pause), ("resume", &mut raw_resume)] {
            let started = Instant::now();
            let output = Reaper::global().output(raw_engine.runsc().args([action, &spec.id]))?;
            samples.0.push(started.elapsed());
            if !output.status.success() {
                bail!("runsc {action} failed: {}", String::from_utf8_lossy(&output.stderr));
            }
        }
        drop(socket);
        runtime.block_on(raw_engine.destroy(&spec))?;
        eprint!("\rbench: {}/{} ", i + 1, args.runs);
    }
    eprintln!();

    println!("{:<44} {:>9} {:>9} {:>6}", "figure (ms)", "p50", "p95", "n");
    let row = |name: &str, s: &Samples| {
        println!("{name:<44} {:>9.1} {:>9.1} {:>6}", s.percentile(50.0), s.percentile(95.0), s.0.len())
    };
    let ratio_named = |name: &str, top: &Samples, bottom: &Samples| {
        let at = |p| top.percentile(p) / bottom.percentile(p);
        println!("{name:<44} {:>9.2} {:>9.2}", at(50.0), at(95.0));
    };
    let ratio = |ours: &Samples, raw: &Samples| ratio_named("ratio ours/raw", ours, raw);
    row("create -> ready, SPACE API (cold)", &create);
    row("create -> agent hello, raw runsc run", &raw_create);
    ratio(&create, &raw_create);
    row("create -> ready, SPACE API (warm pool)", &warm_create);
    ratio_named("speed-up warm vs cold", &create, &warm_create);
    row("create -> ready, SPACE API (hot pool)", &hot_create);
    ratio_named("speed-up hot vs cold", &create, &hot_create);
    tail_create.0.extend(&create.0);
    let tail = format!("cold create tail: p95/p50 ({} creates)", tail_create.0.len());
    println!("{:<44} {:>9.2}", tail, tail_create.percentile(95.0) / tail_create.percentile(50.0));
    for (step, samples) in &cold_steps.0 {
        row(&format!("  cold step: {}", step.trim_start_matches("starting the sandbox: ")), samples);
    }
    pools_settled(&hot_platform, 2, 1)?;
    println!("{:<44} {:>9.1} % of a core each", "hot members' CPU while they wait", hot_idle_cpu(&hot_platform));
    row("exec `true` round trip, SPACE API", &exec);
    row("exec `true`, raw runsc exec", &raw_exec);
    ratio(&exec, &raw_exec);
    row("exec `true`, metrics+logs+events on", &observed);
    row("exec `true`, metrics+logs+events off", &unobserved);
    ratio_named("cost of observability (on/off)", &observed, &unobserved);
    row("exec `bash -l -c true`, SPACE API", &bash_exec);
    row("E2B commands.run(\"true\") (the same argv)", &e2b_run);
    ratio_named("ratio E2B/SPACE", &e2b_run, &bash_exec);
    if !in_guest.0.is_empty() {
        row("posix_spawn `true` + wait, inside the sandbox", &in_guest);
    }
    row("pause, SPACE API", &pause);
    row("pause, raw runsc pause", &raw_pause);
    ratio(&pause, &raw_pause);
    row("resume (from paused), SPACE API", &resume);
    row("resume, raw runsc resume", &raw_resume);
    ratio(&resume, &raw_resume);
    row("suspend (quiesce + checkpoint), SPACE API", &suspend);
    row("resume from suspend, SPACE API", &restore);
    snapshot_bytes.sort_unstable();
    if let Some(median) = snapshot_bytes.get(snapshot_bytes.len() / 2) {
        println!(
            "{:<44} {:>9.1} MiB (median of {})",
            "snapshot size on disk",
            *median as f64 / (1u64 << 20) as f64,
            snapshot_bytes.len()
        );
    }
    if let Some(t) = &throughput {
        println!("{:<44} {:>9.0} MB/s", "stdout streaming through the API", t.api_stream);
        println!("{:<44} {:>9.0} MB/s", "the same bytes from a local pipe on the host", t.local_pipe);
        println!("{:<44} {:>9.2}", "ratio API/local pipe", t.api_stream / t.local_pipe);
        println!("{:<44} {:>9.0} MB/s", "the same bytes through a pipe inside gVisor", t.guest_pipe);
        println!("{:<44} {:>9.2}", "ratio API/pipe inside gVisor", t.api_stream / t.guest_pipe);
        println!("{:<44} {:>9.0} MB/s", "file upload (PUT 64 MiB)", t.upload);
        println!("{:<44} {:>9.0} MB/s", "file download (GET 64 MiB)", t.download);
    }
    for line in previews.iter().flatten() {
        println!("{line}");
    }
    if let Some(e) = &egress {
        println!("{:<44} {:>9.0} MB/s", "download through egress (1 GiB, urllib)", e.through);
        println!("{:<44} {:>9.0} MB/s", "the same download on the host, direct", e.direct);
        println!("{:<44} {:>9.2}", "ratio egress/direct", e.through / e.direct);
        println!("{:<44} {:>9.2} ms", "request through egress, p50 (connect+GET)", e.request_through_ms);
        println!("{:<44} {:>9.2} ms", "the same request on the host, direct, p50", e.request_direct_ms);
        println!("{:<44} {:>9.1} MiB", "server (gateway) RSS growth, 1 GiB download", e.server_growth_mib);
        println!("{:<44} {:>9.1} MiB", "server (gateway) peak RSS during it", e.server_peak_mib);
    }
    idle_pss.sort_unstable();
    if let Some(&pss) = idle_pss.get(idle_pss.len() / 2) {
        // How many fit is observed, not divided out: `--density N`.
        println!(
            "{:<44} {:>9.1} MiB (median of {})",
            "idle sandbox memory (PSS of its processes)",
            pss as f64 / (1u64 << 20) as f64,
            idle_pss.len()
        );
    }
    bench_snapshots(args, &client, &warm_client, &warm_platform, scratch, &create)?;
    bench_contexts(args, &client, scratch, &exec)?;
    if !args.skip_templates {
        bench_templates(args, &client, scratch)?;
    }
    match space_engine::firecracker::find_firecracker(args.engine.firecracker_bin.as_deref()) {
        Some(binary) => runtime.block_on(bench_firecracker(&binary, scratch, args.runs))?,
        None => println!("{:<44} skipped: no firecracker binary (FIRECRACKER_BIN)", "firecracker figures"),
    }
    runtime.block_on(warm_platform.warm().drain());
    runtime.block_on(hot_platform.warm().drain());
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// A source for forks and snapshot templates: python3 holding 64 MiB it
/// touched and a module it imported.
const SOURCE: &str = "nohup python3 -c 'import decimal, time\nx = bytearray(64 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nopen(\"/tmp/ready\", \"w\").close()\ntime.sleep(1e9)' >/dev/null 2>&1 & for i in $(seq 100); do [ -e /tmp/ready ] && break; sleep 0.1; done";

/// Starts a source sandbox on `client`.
fn snapshot_source(client: &Client, template: &str) -> Result<String> {
    let id = timed_create(client, template, &mut Samples(vec![]))?;
    let ready = client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"cmd": SOURCE}))?;
    if ready["result"]["exit_code"] != 0 {
        bail!("the fork source did not start: {ready}");
    }
    Ok(id)
}

/// Makes snapshot template `name` of sandbox `id`.
fn snapshot_template(client: &Client, name: &str, id: &str) -> Result<()> {
    let accepted = client.post("/v1/templates", &serde_json::json!({"name": name, "from": {"sandbox": id}}))?;
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("the snapshot template failed: {}", operation["error"]);
    }
    Ok(())
}

/// Forks, and snapshot templates, in the same run: how long a fork freezes
/// its source, until one fork answers (`true` through the API) and until
/// four do; creates from a snapshot template (cold, and from the warm
/// pool) beside a plain cold create; and what a fork costs in disk (what
/// its root holds alone) and memory (PSS of its processes).
fn bench_snapshots(
    args: &BenchArgs,
    client: &Client,
    warm_client: &Client,
    warm_platform: &space_server::Platform,
    scratch: &DataDir,
    plain_cold: &Samples,
) -> Result<()> {
    let source = snapshot_source(client, &args.template)?;
    let (mut frozen, mut first, mut four, mut cold, mut warm) =
        (Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]));
    let (mut disk, mut memory) = (Vec::new(), Vec::new());
    let answer = |id: &str| -> Result<()> {
        let ran = client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": ["true"]}))?;
        if ran["result"]["exit_code"] != 0 {
            bail!("a fork did not answer: {ran}");
        }
        Ok(())
    };
    let fork = |count: u32| -> Result<(Vec<String>, Value)> {
        let accepted = client.post(&format!("/v1/sandboxes/{source}/fork"), &serde_json::json!({"count": count}))?;
        let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
        if operation["state"] != "succeeded" {
            bail!("a fork failed: {}", operation["error"]);
        }
        let ids = accepted["sandboxes"].as_array().into_iter().flatten();
        Ok((ids.map(|s| s["id"].as_str().unwrap_or_default().to_string()).collect(), operation))
    };
    let delete =
        |client: &Client, ids: &[String]| -> Result<()> { ids.iter().try_for_each(|id| delete_and_wait(client, id)) };
    for i in 0..args.runs {
        let started = Instant::now();
        let (one, operation) = fork(1)?;
        answer(&one[0])?;
        first.0.push(started.elapsed());
        frozen.0.push(Duration::from_millis(operation["frozen_ms"].as_u64().unwrap_or(0)));
        if let Some(&pss) = crate::bench::density::pss_by_sandbox(&one).get(&one[0]) {
            memory.push(pss);
        }
        disk.push(space_host::btrfs::exclusive_bytes(&scratch.sandbox_dir(&one[0]).join("rootfs")).unwrap_or(0));
        delete(client, &one)?;
        let started = Instant::now();
        let (many, _) = fork(4)?;
        for id in &many {
            answer(id)?;
        }
        four.0.push(started.elapsed());
        delete(client, &many)?;
        eprint!("\rbench: forks {}/{} ", i + 1, args.runs);
    }
    eprintln!();
    // Snapshot templates: the cold server makes one of the source; the warm
    // one makes its own (its pool keeps a member of it).
    snapshot_template(client, "bench-snapshot", &source)?;
    let warm_source = snapshot_source(warm_client, &args.template)?;
    snapshot_template(warm_client, "bench-snapshot", &warm_source)?;
    for _ in 0..args.runs {
        let id = timed_create(client, "bench-snapshot", &mut cold)?;
        delete(client, &[id])?;
        let refill_deadline = Instant::now() + Duration::from_secs(60);
        while warm_platform.warm().count() < 2 && Instant::now() < refill_deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let id = timed_create(warm_client, "bench-snapshot", &mut warm)?;
        delete(warm_client, &[id])?;
    }
    delete(client, &[source])?;
    delete(warm_client, &[warm_source])?;
    for client in [client, warm_client] {
        client.delete_empty("/v1/templates/bench-snapshot")?;
    }

    let row = |name: &str, s: &Samples| {
        println!("{name:<44} {:>9.1} {:>9.1} {:>6}", s.percentile(50.0), s.percentile(95.0), s.0.len())
    };
    row("fork: source frozen (pause+snapshot+thaw)", &frozen);
    row("fork x1: accepted -> the fork answers", &first);
    row("fork x4: accepted -> all four answer", &four);
    row("create -> ready, snapshot template (cold)", &cold);
    row("create -> ready, snapshot template (warm)", &warm);
    row("create -> ready, plain template (cold)", plain_cold);
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).map(|b| *b as f64 / (1u64 << 20) as f64).unwrap_or(f64::NAN)
    };
    let runs = disk.len();
    println!("{:<44} {:>9.1} MiB (median of {runs})", "fork: disk its root holds alone", median(disk));
    println!("{:<44} {:>9.1} MiB (median of {})", "fork: memory (PSS, source touched 64 MiB)", median(memory), runs);
    Ok(())
}

/// A code context's round trip, `run("1+1")` through the API until its
/// `end`, beside `exec true` of the same run.
fn bench_contexts(args: &BenchArgs, client: &Client, scratch: &DataDir, exec: &Samples) -> Result<()> {
    let interpreter = space_host::template::CODE_INTERPRETER_TEMPLATE;
    if scratch.template(interpreter).is_none() {
        println!(
            "{:<44} skipped: no {interpreter} template (space setup --with-template {interpreter})",
            "code context figures"
        );
        return Ok(());
    }
    let id = timed_create(client, interpreter, &mut Samples(vec![]))?;
    let started = Instant::now();
    let context = client.post(&format!("/v1/sandboxes/{id}/contexts"), &serde_json::json!({}))?;
    let ready = started.elapsed();
    let path = format!("/v1/sandboxes/{id}/contexts/{}/run", context["id"].as_str().unwrap_or_default());
    let mut runs = Samples(vec![]);
    for _ in 0..args.runs * args.execs {
        let started = Instant::now();
        let (status, body) =
            client.post_bytes(&path, &[("Content-Type", "application/json")], br#"{"code": "1+1"}"#)?;
        runs.0.push(started.elapsed());
        let body = String::from_utf8_lossy(&body);
        if status != 200 || !body.contains(r#""text/plain":"2""#) {
            bail!("a context run failed: {status} {body}");
        }
    }
    let deleted = client.delete(&format!("/v1/sandboxes/{id}"))?;
    client.wait_operation(deleted["operation"]["id"].as_str().unwrap_or_default())?;
    let row = |name: &str, s: &Samples| {
        println!("{name:<44} {:>9.1} {:>9.1} {:>6}", s.percentile(50.0), s.percentile(95.0), s.0.len())
    };
    row("code context: run(\"1+1\") until its end", &runs);
    row("exec `true` round trip (same run)", exec);
    println!("{:<44} {:>9.1} ms", "code context: create until the interpreter answers", ready.as_secs_f64() * 1000.0);
    Ok(())
}

/// Private memory (Private_Clean + Private_Dirty) of a process, in bytes.
fn private_bytes(pid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// Firecracker's VMM side, beside gVisor's figures: spawn to API ready,
/// configure and InstanceStart, a full snapshot, and five clones loaded
/// from it (private memory each: clones share the snapshot's pages). On
/// hosts without vmx/svm the guest does not come up; these are VMM figures.
async fn bench_firecracker(binary: &std::path::Path, scratch: &DataDir, runs: usize) -> Result<()> {
    use space_engine::firecracker::api::{
        BootSource, Drive, MachineConfig, MemBackend, SnapshotCreate, SnapshotLoad, Vsock, VsockOverride,
    };
    use space_engine::firecracker::Vmm;
    let guest = space_host::guest::existing(scratch)
        .or_else(|| DataDir::open(&scratch.root().join("../..")).ok().and_then(|d| space_host::guest::existing(&d)))
        .context("the guest kernel: run `space setup`")?;
    let work = scratch.root().join("bench-firecracker");
    let (mut ready, mut start, mut snapshot, mut load) =
        (Samples(vec![]), Samples(vec![]), Samples(vec![]), Samples(vec![]));
    let mut private = Vec::new();
    for i in 0..runs.max(1) {
        let dir = work.join(format!("vm-{i}"));
        let vmm = Vmm::spawn(binary, &dir, &format!("bench-{}-{i}", std::process::id())).await?;
        ready.0.push(vmm.ready_after);
        let root = dir.join("root.ext4");
        std::fs::write(&root, vec![0u8; 1 << 20])?;
        let started = Instant::now();
        vmm.api
            .boot_source(&BootSource {
                kernel_image_path: guest.kernel.clone(),
                initrd_path: Some(guest.initramfs.clone()),
                boot_args: "console=ttyS0 reboot=k panic=1 pci=off".into(),
            })
            .await?;
        vmm.api
            .machine_config(&MachineConfig { vcpu_count: 1, mem_size_mib: 256, smt: false, track_dirty_pages: false })
            .await?;
        vmm.api
            .drive(&Drive { drive_id: "root".into(), path_on_host: root, is_root_device: true, is_read_only: false })
            .await?;
        vmm.api.vsock(&Vsock { guest_cid: 3, uds_path: dir.join("vsock.sock") }).await?;
        vmm.api.start().await?;
        start.0.push(started.elapsed());
        if i == 0 {
            vmm.api.pause().await?;
            let started = Instant::now();
            let (state, memory) = (work.join("vm.state"), work.join("vm.mem"));
            vmm.api
                .snapshot_create(&SnapshotCreate {
                    snapshot_type: "Full",
                    snapshot_path: state.clone(),
                    mem_file_path: memory.clone(),
                })
                .await?;
            snapshot.0.push(started.elapsed());
            drop(vmm);
            let mut clones = Vec::new();
            for n in 0..5 {
                let clone_dir = work.join(format!("clone-{n}"));
                let clone = Vmm::spawn(binary, &clone_dir, &format!("bench-clone-{}-{n}", std::process::id())).await?;
                let started = Instant::now();
                clone
                    .api
                    .snapshot_load(&SnapshotLoad {
                        snapshot_path: state.clone(),
                        mem_backend: MemBackend { backend_type: "File", backend_path: memory.clone() },
                        resume_vm: false,
                        vsock_override: Some(VsockOverride { uds_path: clone_dir.join("vsock.sock") }),
                    })
                    .await?;
                load.0.push(started.elapsed());
                clones.push(clone);
            }
            private.extend(clones.iter().map(|c| private_bytes(c.pid())));
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    let row = |name: &str, s: &Samples| {
        println!("{name:<44} {:>9.1} {:>9.1} {:>6}", s.percentile(50.0), s.percentile(95.0), s.0.len())
    };
    row("firecracker: spawn -> API ready", &ready);
    row("firecracker: configure + InstanceStart", &start);
    row("firecracker: full snapshot (256 MiB)", &snapshot);
    row("firecracker: snapshot load (clone, x5)", &load);
    private.sort_unstable();
    if let Some(median) = private.get(private.len() / 2) {
        println!(
            "{:<44} {:>9.1} MiB (median of {})",
            "firecracker: private memory per clone",
            *median as f64 / (1u64 << 20) as f64,
            private.len()
        );
    }
    Ok(())
}

/// Template figures: a `base` build (packages from the shared apt cache)
/// and the import of a generated OCI archive of `--image-mib`.
fn bench_templates(args: &BenchArgs, client: &Client, scratch: &DataDir) -> Result<()> {
    use space_host::oci::{write_archive, ArchiveFormat, ImageSettings};
    // Share the serving data dir's package cache, as a second build would.
    let shared_cache = DataDir::open(&args.data_dir)?.apt_cache_dir();
    let cache = scratch.apt_cache_dir();
    if shared_cache.is_dir() && !cache.exists() {
        std::fs::create_dir_all(cache.parent().unwrap_or(scratch.root()))?;
        std::os::unix::fs::symlink(&shared_cache, &cache)?;
    }
    eprintln!("bench: building a `base` template (apt cache shared) and importing a {} MiB image", args.image_mib);
    let request = serde_json::json!({"name": "bench-base", "from": {"debian": {
        "packages": space_host::template::BASE_PACKAGES}}});
    let started = Instant::now();
    let accepted = client.post("/v1/templates", &request)?;
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("building bench-base failed: {}", operation["error"]);
    }
    let build = started.elapsed();
    let built = scratch.template("bench-base").context("the built template vanished")?;
    let rootfs_bytes = dir_size(&built.rootfs());

    // A one-layer image of incompressible files, as `docker save` writes it.
    let work = scratch.root().join("bench-image");
    std::fs::create_dir_all(&work)?;
    let layer_path = work.join("layer.tar");
    let mut layer = tar::Builder::new(std::io::BufWriter::new(std::fs::File::create(&layer_path)?));
    let chunk: Vec<u8> = (0..8u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    for n in 0..args.image_mib.div_ceil(8) {
        let mut header = tar::Header::new_gnu();
        header.set_size(chunk.len() as u64);
        header.set_mode(0o644);
        layer.append_data(&mut header, format!("data/file-{n}.bin"), &chunk[..])?;
    }
    layer.into_inner()?.into_inner().map_err(|e| e.into_error())?;
    let archive = work.join("image.tar");
    write_archive(&archive, ArchiveFormat::DockerSave, &[layer_path], &ImageSettings::default())?;
    let archive_bytes = std::fs::metadata(&archive)?.len();
    let started = Instant::now();
    let accepted =
        client.post_stream("/v1/templates?name=bench-image", "application/x-tar", std::fs::File::open(&archive)?)?;
    let uploaded = started.elapsed();
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("importing the bench image failed: {}", operation["error"]);
    }
    let total = started.elapsed();
    let _ = std::fs::remove_dir_all(&work);

    let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
    println!("{:<44} {:>9.1} s", "template build `base` (mmdebstrap, cached)", build.as_secs_f64());
    println!("{:<44} {:>9.1} MiB", "template `base` root size", mib(rootfs_bytes));
    println!("{:<44} {:>9.1} MiB", "generated image archive (docker save)", mib(archive_bytes));
    println!("{:<44} {:>9.0} MB/s", "image upload (POST body to disk)", mb_per_s(archive_bytes, uploaded));
    println!("{:<44} {:>9.0} MB/s", "image import (layers applied)", mb_per_s(archive_bytes, total - uploaded));
    println!("{:<44} {:>9.0} MB/s", "image upload + import, end to end", mb_per_s(archive_bytes, total));
    Ok(())
}
