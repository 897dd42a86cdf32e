//! `space bench --only-pull`: a template of an image in a registry against
//! the floor of copying that image with Debian's `skopeo`, in one run.
//!
//! The image (`--pull-mib` over five gzip layers of half-compressible
//! files) is pushed to Debian's `docker-registry` on loopback. Each round
//! times `skopeo copy docker://… oci:DIR` (the blobs downloaded and
//! checked, nothing unpacked: the floor) and a cold pull through the API
//! (`POST /v1/templates {"from": {"image"}}` until its operation succeeded:
//! resolved, downloaded, checked, applied as layer chains, agent installed,
//! published), alternately, on a server whose layer cache keeps nothing.
//! Then a second server, whose cache keeps the image's chains, times a
//! re-pull of an image pulled once (every layer cached), and a Dockerfile
//! build with three RUN steps, then the same with its last RUN changed: the
//! steps that ran and were cached as its log says.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use space_host::datadir::DataDir;
use space_process::{ReapedChild, Reaper};

use super::{start_server, Samples};
use crate::cli::BenchArgs;
use crate::client::Client;

const REGISTRY_BIN: &str = "/usr/bin/docker-registry";
const SKOPEO_BIN: &str = "/usr/bin/skopeo";
/// Layers of the generated image.
const LAYERS: u64 = 5;
/// Rounds of each cold figure (a pull of hundreds of MiB each).
const ROUNDS: usize = 3;
/// The goals of issue 36: a cold pull within 1.2× skopeo's copy, a
/// cached one within a second.
const COLD_GOAL: f64 = 1.2;
const CACHED_GOAL: Duration = Duration::from_secs(1);
/// Issue 36's goal for a rebuild with its last RUN changed.
const REBUILT_GOAL: usize = 1;

/// A registry on loopback, killed when dropped.
struct Registry {
    host: String,
    child: ReapedChild,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::SIGKILL);
        let _ = self.child.wait_timeout(Duration::from_secs(10));
    }
}

fn start_registry(work: &Path) -> Result<Registry> {
    anyhow::ensure!(Path::new(REGISTRY_BIN).is_file(), "{REGISTRY_BIN} is missing: install Debian's docker-registry");
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let config = work.join("registry.yml");
    let storage = work.join("registry");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog: {{level: warn, accesslog: {{disabled: true}}}}\nstorage: {{filesystem: \
             {{rootdirectory: {}}}}}\nhttp: {{addr: \"127.0.0.1:{port}\"}}\n",
            storage.display()
        ),
    )?;
    let mut command = Command::new(REGISTRY_BIN);
    command.arg("serve").arg(&config).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    let child = Reaper::global().spawn(&mut command).context("starting the registry")?;
    let registry = Registry { host: format!("127.0.0.1:{port}"), child };
    let deadline = Instant::now() + Duration::from_secs(30);
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(2)).build();
    loop {
        match agent.get(&format!("http://{}/v2/", registry.host)).call() {
            Ok(_) => return Ok(registry),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(err) => bail!("the registry did not answer within 30 s: {err}"),
        }
    }
}

/// `skopeo ARGS` with a home of its own (no user's auth file or policy).
fn skopeo(work: &Path, args: &[&str]) -> Result<()> {
    anyhow::ensure!(Path::new(SKOPEO_BIN).is_file(), "{SKOPEO_BIN} is missing: install Debian's skopeo");
    let mut command = Command::new(SKOPEO_BIN);
    command.env("HOME", work).args(["--insecure-policy"]).args(args).stdin(Stdio::null());
    space_host::run(&mut command)?;
    Ok(())
}

/// An OCI archive of `mib` MiB over [`LAYERS`] layers of files that
/// compress about two to one, as real layers do.
fn write_image(work: &Path, mib: u64) -> Result<PathBuf> {
    use space_host::oci::{write_archive, ArchiveFormat, ImageSettings};
    let per_layer = mib.div_ceil(LAYERS).max(1);
    let mut layers = Vec::new();
    for n in 0..LAYERS {
        let path = work.join(format!("layer-{n}.tar"));
        let mut tar = tar::Builder::new(std::io::BufWriter::new(std::fs::File::create(&path)?));
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15 ^ n;
        for file in 0..per_layer {
            // Half random bytes, half runs: gzip gets about 2:1.
            let chunk: Vec<u8> = (0..1u32 << 20)
                .map(|i| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    if i % 2 == 0 {
                        seed as u8
                    } else {
                        b'x'
                    }
                })
                .collect();
            let mut header = tar::Header::new_gnu();
            header.set_size(chunk.len() as u64);
            header.set_mode(0o644);
            tar.append_data(&mut header, format!("layer{n}/file-{file}.bin"), &chunk[..])?;
        }
        tar.into_inner()?.into_inner().map_err(|e| e.into_error())?;
        layers.push(path);
    }
    let archive = work.join("image.tar");
    write_archive(&archive, ArchiveFormat::OciLayout, &layers, &ImageSettings::default())?;
    for layer in layers {
        std::fs::remove_file(layer)?;
    }
    Ok(archive)
}

/// Unpacks every gzip layer blob of the OCI layout `layout` into `root`
/// with GNU tar, lowest first as the manifest lists them: the floor of a
/// pull that makes a root (no whiteouts in the generated image).
fn unpack_layers(layout: &Path, root: &Path) -> Result<()> {
    std::fs::create_dir_all(root)?;
    let blob = |digest: &str| layout.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
    let manifest_digest = index["manifests"][0]["digest"].as_str().context("the copy's index names no manifest")?;
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(blob(manifest_digest))?)?;
    for layer in manifest["layers"].as_array().into_iter().flatten() {
        let digest = layer["digest"].as_str().context("a layer without a digest")?;
        let mut command = Command::new("tar");
        command.arg("-xzf").arg(blob(digest)).arg("-C").arg(root);
        space_host::run(&mut command)?;
    }
    Ok(())
}

/// A template of `image` through the API, until its operation succeeded.
fn pull(client: &Client, name: &str, image: &str) -> Result<Duration> {
    let started = Instant::now();
    let accepted = client.post("/v1/templates", &serde_json::json!({"name": name, "from": {"image": image}}))?;
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("pulling {image} failed: {}", operation["error"]);
    }
    Ok(started.elapsed())
}

/// A Dockerfile build of template `name` (no context), until its operation
/// succeeded; its time and log.
fn build(client: &Client, name: &str, dockerfile: &str) -> Result<(Duration, String)> {
    const BOUNDARY: &str = "space-bench-boundary";
    let request = serde_json::json!({"name": name, "dockerfile": dockerfile});
    let body = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"build\"\r\nContent-Type: application/json\r\n\r\n\
         {request}\r\n--{BOUNDARY}--\r\n"
    );
    let started = Instant::now();
    let content_type = format!("multipart/form-data; boundary={BOUNDARY}");
    let accepted = client.post_stream("/v1/templates/builds", &content_type, body.as_bytes())?;
    let id = accepted["operation"]["id"].as_str().unwrap_or_default();
    let operation = client.wait_operation(id)?;
    let took = started.elapsed();
    let log = client.get_text(&format!("/v1/operations/{id}/log"))?;
    if operation["state"] != "succeeded" {
        bail!("building {name} failed: {}\n{log}", operation["error"]);
    }
    Ok((took, log))
}

pub(crate) fn run(args: &BenchArgs, cold: &DataDir, cached: &DataDir) -> Result<()> {
    let work = cold.root().join("bench-pull");
    std::fs::create_dir_all(&work)?;
    eprintln!("bench: pushing a {} MiB image of {LAYERS} layers to a registry on loopback", args.pull_mib);
    let archive = write_image(&work, args.pull_mib)?;
    let registry = start_registry(&work)?;
    let image = format!("{}/bench/app:1", registry.host);
    let archive_arg = format!("oci-archive:{}", archive.display());
    skopeo(&work, &["copy", "--dest-tls-verify=false", &archive_arg, &format!("docker://{image}")])?;
    let image_bytes = std::fs::metadata(&archive)?.len();

    let runtime = tokio::runtime::Runtime::new()?;
    let config = |data: &DataDir, cache_mib: u64| -> Result<space_server::PlatformConfig> {
        let mut config = args.engine.platform_config(data.root())?;
        (config.warm_pool, config.hot_pool) = (0, 0);
        config.registry.insecure = vec![registry.host.clone()];
        config.layer_cache_mib = cache_mib;
        Ok(config)
    };
    // Nothing kept between rounds: every pull is cold.
    let (client, cold_platform) = start_server(&runtime, config(cold, 0)?)?;
    let (mut floor, mut unpacked, mut ours) = (Samples(vec![]), Samples(vec![]), Samples(vec![]));
    for round in 0..ROUNDS {
        let copy = work.join(format!("copy-{round}"));
        let started = Instant::now();
        skopeo(
            &work,
            &["copy", "--src-tls-verify=false", &format!("docker://{image}"), &format!("oci:{}:1", copy.display())],
        )?;
        floor.0.push(started.elapsed());
        unpack_layers(&copy, &work.join(format!("root-{round}")))?;
        unpacked.0.push(started.elapsed());
        std::fs::remove_dir_all(&copy)?;
        std::fs::remove_dir_all(work.join(format!("root-{round}")))?;
        ours.0.push(pull(&client, &format!("pull-{round}"), &image)?);
    }
    runtime.block_on(cold_platform.shutdown());

    // A cache that keeps the image: one pull, then re-pulls.
    let (client, cached_platform) = start_server(&runtime, config(cached, space_server::DEFAULT_LAYER_CACHE_MIB)?)?;
    pull(&client, "warm", &image)?;
    let mut again = Samples(vec![]);
    for round in 0..ROUNDS {
        again.0.push(pull(&client, &format!("again-{round}"), &image)?);
    }
    // Three RUN steps, then only the last one changed, on the bench's
    // template: the generated image has no shell for a RUN. A first build
    // takes the template's root as a chain, so neither timed build does.
    let base = &args.template;
    let dockerfile = |last: &str| {
        format!("FROM template:{base}\nRUN echo one > /one\nRUN echo two > /two\nRUN echo {last} > /three\n")
    };
    build(&client, "base-taken", &format!("FROM template:{base}\nRUN true\n"))?;
    let (built, _) = build(&client, "built", &dockerfile("three"))?;
    let (rebuilt, log) = build(&client, "built", &dockerfile("changed"))?;
    let (ran, cached) = (log.matches(": saved").count(), log.matches(": cached").count());
    runtime.block_on(cached_platform.shutdown());
    drop(registry);
    let _ = std::fs::remove_dir_all(&work);

    let (floor_ms, ours_ms, again_ms) = (floor.percentile(50.0), ours.percentile(50.0), again.percentile(50.0));
    let unpacked_ms = unpacked.percentile(50.0);
    let ratio = ours_ms / floor_ms;
    println!("{:<44} {:>9.1} MiB", "pulled image (gzip layers, OCI archive)", image_bytes as f64 / f64::from(1 << 20));
    println!("{:<44} {:>9.0} ms", "skopeo copy docker:// → oci: (floor), p50", floor_ms);
    println!("{:<44} {:>9.0} ms", "skopeo copy + tar -xzf each layer, p50", unpacked_ms);
    println!("{:<44} {:>9.0} ms", "template from the image, cold, p50", ours_ms);
    println!("{:<44} {:>9.2} ×", "cold pull / (skopeo copy + tar -xzf)", ours_ms / unpacked_ms);
    println!(
        "{:<44} {:>9.2} ×   goal ≤ {COLD_GOAL} ×: {}",
        "cold pull / skopeo copy",
        ratio,
        if ratio <= COLD_GOAL { "met" } else { "missed" }
    );
    println!(
        "{:<44} {:>9.0} ms  goal ≤ {} ms: {}",
        "template from the image, layers cached, p50",
        again_ms,
        CACHED_GOAL.as_millis(),
        if again_ms <= CACHED_GOAL.as_secs_f64() * 1000.0 { "met" } else { "missed" }
    );
    println!("{:<44} {:>9.0} ms", "Dockerfile of 3 RUN steps, built", built.as_secs_f64() * 1000.0);
    println!("{:<44} {:>9.0} ms", "the same, last RUN changed", rebuilt.as_secs_f64() * 1000.0);
    println!(
        "{:<44} {ran:>3} ran, {cached} cached  goal: {REBUILT_GOAL} ran: {}",
        "its steps, as its log says",
        if ran == REBUILT_GOAL { "met" } else { "missed" }
    );
    Ok(())
}
