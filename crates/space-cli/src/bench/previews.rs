//! Previews against the path form, in the same run: a small request's
//! round trip on a port's own host name (`{port}-{id}.{domain}`, with the
//! sandbox's preview token) and through `/v1/sandboxes/{id}/ports/{port}/…`
//! (with the API key), interleaved over one kept-alive client each; and a
//! 100 MiB download through the preview against the files route.

use std::io::Read as _;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use space_client::Client;

use super::{mb_per_s, Samples};

/// The domain the bench's server serves previews under.
pub(crate) const DOMAIN: &str = "preview.bench.space.test";
const BIG: u64 = 100 << 20;
const PORT: u16 = 8000;

fn read_all(response: ureq::Response) -> Result<u64> {
    let mut reader = response.into_reader();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        match reader.read(&mut buf)? {
            0 => return Ok(total),
            n => total += n as u64,
        }
    }
}

/// The figures' lines, printed with the others at the end of the run.
pub(crate) fn measure(client: &Client, id: &str, requests: usize) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let start = format!(
        "mkdir -p /srv && head -c {BIG} /dev/zero > /srv/big.bin && echo ok > /srv/small.txt && cd /srv && \
         nohup python3 -m http.server {PORT} >/dev/null 2>&1 &"
    );
    let ran = client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"cmd": start}))?;
    if ran["result"]["exit_code"] != 0 {
        bail!("starting the server for the preview figures: {ran}");
    }
    let token = client.get(&format!("/v1/sandboxes/{id}/ports"))?["preview_token"]
        .as_str()
        .context("no preview token")?
        .to_string();
    let addr: std::net::SocketAddr = client.base().trim_start_matches("http://").parse()?;
    let agent =
        || ureq::AgentBuilder::new().timeout(Duration::from_secs(300)).resolver(move |_: &str| Ok(vec![addr])).build();
    let (preview_agent, path_agent) = (agent(), agent());
    let preview = format!("http://{PORT}-{}.{DOMAIN}:{}", id.replace('_', "-"), addr.port());
    let path_form = format!("{}/v1/sandboxes/{id}/ports/{PORT}", client.base());
    let auth = format!("Bearer {}", client.key());
    let small_preview = || {
        preview_agent.get(&format!("{preview}/small.txt")).set("X-Space-Preview-Token", &token).call().map_err(Box::new)
    };
    let small_path =
        || path_agent.get(&format!("{path_form}/small.txt")).set("Authorization", &auth).call().map_err(Box::new);
    let deadline = Instant::now() + Duration::from_secs(60);
    while small_preview().is_err() {
        if Instant::now() > deadline {
            bail!("the server in the sandbox never answered on its preview host");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (mut on_preview, mut on_path) = (Samples(vec![]), Samples(vec![]));
    for _ in 0..requests {
        let started = Instant::now();
        read_all(small_path()?)?;
        on_path.0.push(started.elapsed());
        let started = Instant::now();
        read_all(small_preview()?)?;
        on_preview.0.push(started.elapsed());
    }
    let (preview_ms, path_ms) = (on_preview.percentile(50.0), on_path.percentile(50.0));
    lines.push(format!("{:<44} {:>9.2} ms", "port request, preview host (p50)", preview_ms));
    lines.push(format!("{:<44} {:>9.2} ms", "port request, path form (p50)", path_ms));
    lines.push(format!("{:<44} {:>9.2} x  (goal <= 1.2)", "  preview / path form", preview_ms / path_ms));

    let started = Instant::now();
    let got = read_all(preview_agent.get(&format!("{preview}/big.bin")).set("X-Space-Preview-Token", &token).call()?)?;
    let through_preview = mb_per_s(got, started.elapsed());
    if got != BIG {
        bail!("the preview download gave {got} of {BIG} bytes");
    }
    let started = Instant::now();
    let got = read_all(path_agent.get(&format!("{path_form}/big.bin")).set("Authorization", &auth).call()?)?;
    let through_path = mb_per_s(got, started.elapsed());
    if got != BIG {
        bail!("the path form's download gave {got} of {BIG} bytes");
    }
    let started = Instant::now();
    let answer = client.open("GET", &format!("/v1/sandboxes/{id}/files?path=/srv/big.bin"), &[])?;
    let mut body = answer.body;
    let got = std::io::copy(&mut body, &mut std::io::sink())?;
    let through_files = mb_per_s(got, started.elapsed());
    if got != BIG {
        bail!("the files route gave {got} of {BIG} bytes");
    }
    lines.push(format!("{:<44} {:>9.0} MB/s", "100 MiB download, preview host", through_preview));
    lines.push(format!("{:<44} {:>9.0} MB/s", "100 MiB download, path form", through_path));
    lines.push(format!("{:<44} {:>9.0} MB/s", "100 MiB download, files route", through_files));
    lines.push(format!("{:<44} {:>9.2} x  (goal >= 0.8)", "  preview / files route", through_preview / through_files));
    Ok(lines)
}

/// `space bench --only-previews`: a server of its own, one sandbox.
pub(crate) fn run(args: &crate::cli::BenchArgs, data: &space_host::datadir::DataDir) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let mut config = args.engine.platform_config(data.root())?;
    config.auto_pause_s = 0;
    let (client, platform) = super::start_server(&runtime, config)?;
    let mut create = Samples(vec![]);
    let id = super::timed_create(&client, &args.template, &mut create)?;
    let measured = measure(&client, &id, args.execs.max(20));
    let _ = super::delete_and_wait(&client, &id);
    runtime.block_on(platform.shutdown());
    for line in measured? {
        println!("{line}");
    }
    Ok(())
}
