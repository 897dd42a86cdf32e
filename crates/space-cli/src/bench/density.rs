//! `space bench --density N`: N sandboxes of the default template alive at
//! once on one host, observed rather than extrapolated. Creates them
//! (several clients at a time), lets the server pause the idle ones, then
//! checks that every one answers an exec — the first exec of a paused one
//! includes its resume on demand — and reports creates per second, exec
//! and resume-on-demand latency across all N, host memory per sandbox (PSS
//! from the kernel, and MemAvailable's drop), host CPU while they idle, and
//! the server's own RSS, threads and open files.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use space_host::datadir::DataDir;

use crate::bench::{start_server, BenchArgs, Samples};
use crate::client::Client;

/// Clients creating sandboxes at once.
const CREATORS: usize = 4;

pub fn run(args: &BenchArgs, scratch: &DataDir, n: usize) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let mut config = args.engine.platform_config(scratch.root())?;
    config.warm_pool = 0;
    config.hot_pool = 0;
    config.auto_pause_s = args.idle_pause_s;
    // Memory promised per sandbox is its memory_mib; what an idle one costs
    // is measured here, so the promise is not what limits this run.
    config.capacity_mib = Some(u64::from(u32::MAX));
    let (client, platform) = start_server(&runtime, config)?;
    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")?.trim().parse()?;
    eprintln!(
        "density: {n} sandboxes of {:?}, {CREATORS} clients creating; idle ones paused after {} s; pid_max {pid_max}",
        args.template, args.idle_pause_s
    );
    let available_before = mem_available().unwrap_or(0);

    // Create all N.
    let ids = Mutex::new(Vec::with_capacity(n));
    let create = Mutex::new(Samples(Vec::new()));
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..CREATORS)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    while next.fetch_add(1, Ordering::Relaxed) < n {
                        let begun = Instant::now();
                        let id = create_one(&client, &args.template)?;
                        create.lock().unwrap().0.push(begun.elapsed());
                        let mut ids = ids.lock().unwrap();
                        ids.push(id);
                        if ids.len() % 25 == 0 {
                            eprint!("\rdensity: {}/{n} created ", ids.len());
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for worker in workers {
            worker.join().map_err(|_| anyhow::anyhow!("a creating client panicked"))??;
        }
        Ok(())
    })?;
    let create_wall = started.elapsed();
    let ids = ids.into_inner().unwrap();
    eprintln!("\rdensity: {n} created in {:.1} s", create_wall.as_secs_f64());

    // All alive; the idle ones go to sleep.
    let settle = Instant::now() + Duration::from_secs(args.idle_pause_s + 60);
    let paused = loop {
        let paused = count_auto_paused(&client)?;
        if paused >= n || Instant::now() > settle {
            break paused;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let pss = pss_by_sandbox(&ids);
    let available_after = mem_available().unwrap_or(0);
    let (cpu_idle, server_cpu_idle) = {
        let ((busy0, total0), own0) = (cpu_busy(), own_cpu_ticks());
        let begun = Instant::now();
        std::thread::sleep(Duration::from_secs(10));
        let ((busy1, total1), own1) = (cpu_busy(), own_cpu_ticks());
        let ticks_per_s = 100.0; // USER_HZ
        let own = (own1 - own0) as f64 / ticks_per_s / begun.elapsed().as_secs_f64();
        ((busy1 - busy0) as f64 / (total1 - total0).max(1) as f64, own)
    };
    let server = process_figures();

    // Every one answers: the first exec wakes a sleeping one, the second
    // finds it running.
    let (mut wake, mut exec) = (Samples(Vec::new()), Samples(Vec::new()));
    let mut answered = 0;
    for id in &ids {
        let asleep = client.get(&format!("/v1/sandboxes/{id}"))?["auto_paused"] == true;
        for round in 0..2 {
            let begun = Instant::now();
            let answer = client.post(&format!("/v1/sandboxes/{id}/exec"), &serde_json::json!({"argv": ["true"]}))?;
            let elapsed = begun.elapsed();
            if answer["result"]["exit_code"] != 0 {
                bail!("{id} did not answer `true`: {answer}");
            }
            match (round, asleep) {
                (0, true) => wake.0.push(elapsed),
                (0, false) => {}
                _ => exec.0.push(elapsed),
            }
        }
        answered += 1;
    }
    let server_after = process_figures();

    // Clean up, timing the deletes.
    let started = Instant::now();
    let deleted = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for chunk in ids.chunks(ids.len().div_ceil(CREATORS).max(1)) {
            let (client, deleted) = (&client, &deleted);
            scope.spawn(move || {
                for id in chunk {
                    let op = client.delete(&format!("/v1/sandboxes/{id}")).ok();
                    let done = op.and_then(|op| client.wait_operation(op["operation"]["id"].as_str()?).ok());
                    deleted.lock().unwrap().push(done.is_some_and(|op| op["state"] == "succeeded"));
                }
            });
        }
    });
    let delete_wall = started.elapsed();
    let deleted = deleted.into_inner().unwrap().into_iter().filter(|ok| *ok).count();
    drop(platform);
    runtime.shutdown_timeout(Duration::from_secs(1));

    let mib = |bytes: f64| bytes / f64::from(1u32 << 20);
    let pss_values: Vec<u64> = ids.iter().filter_map(|id| pss.get(id).copied()).collect();
    let pss_mean = pss_values.iter().sum::<u64>() as f64 / pss_values.len().max(1) as f64;
    println!("{:<52} {:>12}", "density figure", "value");
    println!("{:<52} {:>12}", "sandboxes alive at once", n);
    println!("{:<52} {:>12.1}", "creates per second (4 clients, cold)", n as f64 / create_wall.as_secs_f64());
    println!("{:<52} {:>12.1}", "create -> ready p50 (ms)", create.lock().unwrap().percentile(50.0));
    println!("{:<52} {:>12.1}", "create -> ready p99 (ms)", create.lock().unwrap().percentile(99.0));
    println!("{:<52} {:>12}", "paused by the server while idle", paused);
    println!("{:<52} {:>12}", "answered an exec", format!("{answered}/{n}"));
    println!("{:<52} {:>12.1}", "exec `true` round trip p50, all alive (ms)", exec.percentile(50.0));
    println!("{:<52} {:>12.1}", "exec `true` round trip p99, all alive (ms)", exec.percentile(99.0));
    println!("{:<52} {:>12.1}", "resume on demand + exec p50 (ms)", wake.percentile(50.0));
    println!("{:<52} {:>12.1}", "resume on demand + exec p99 (ms)", wake.percentile(99.0));
    println!("{:<52} {:>12}", "resumes on demand measured", wake.0.len());
    println!("{:<52} {:>12.1}", "host memory per sandbox, PSS mean (MiB)", mib(pss_mean));
    println!(
        "{:<52} {:>12.1}",
        "host memory per sandbox, MemAvailable drop / N (MiB)",
        mib(available_before.saturating_sub(available_after) as f64 / n as f64)
    );
    println!("{:<52} {:>12.1}", "host CPU busy while all idle (% of all cores)", cpu_idle * 100.0);
    println!("{:<52} {:>12.1}", "server CPU while all idle (% of one core)", server_cpu_idle * 100.0);
    for (when, figures) in [("with all alive", &server), ("after the execs", &server_after)] {
        println!("{:<52} {:>12.1}", format!("server RSS, {when} (MiB)"), mib(figures.rss as f64));
        println!("{:<52} {:>12}", format!("server threads, {when}"), figures.threads);
        println!("{:<52} {:>12}", format!("server open files, {when}"), figures.fds);
    }
    println!("{:<52} {:>12.1}", "deletes per second (4 clients)", deleted as f64 / delete_wall.as_secs_f64());
    if answered < n || deleted < n {
        bail!("{answered} of {n} answered, {deleted} of {n} deleted");
    }
    Ok(())
}

fn create_one(client: &Client, template: &str) -> Result<String> {
    let accepted = client.post("/v1/sandboxes", &serde_json::json!({"template": template}))?;
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("create failed: {}", operation["error"]);
    }
    Ok(accepted["sandbox"]["id"].as_str().context("no sandbox id")?.to_string())
}

pub(crate) fn count_auto_paused(client: &Client) -> Result<usize> {
    let list = client.get("/v1/sandboxes?state=paused")?;
    let sandboxes = list["sandboxes"].as_array().context("no sandbox list")?;
    Ok(sandboxes.iter().filter(|s| s["auto_paused"] == true).count())
}

/// Busy and total jiffies of all CPUs, from /proc/stat.
fn cpu_busy() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    let total: u64 = fields.iter().sum();
    // idle and iowait are fields 4 and 5.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPU time (user + system, in clock ticks) this process used so far.
fn own_cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
    let field = |n: usize| fields.get(n).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    field(11) + field(12)
}

/// This process's (the in-process server's) RSS, threads and open files.
struct ProcessFigures {
    rss: u64,
    threads: u64,
    fds: usize,
}

fn process_figures() -> ProcessFigures {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        status.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse().ok()).unwrap_or(0)
    };
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    ProcessFigures { rss: field("VmRSS:") << 10, threads: field("Threads:"), fds }
}

/// The PSS of each sandbox's processes (runsc sandbox and gofer, which
/// name it in their command line, and their descendants), in one pass.
pub(crate) fn pss_by_sandbox(ids: &[String]) -> HashMap<String, u64> {
    let wanted: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
    let mut owner: HashMap<u32, String> = HashMap::new();
    let mut parent: Vec<(u32, u32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let ppid = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1)).and_then(|p| p.parse().ok());
        parent.push((pid, ppid.unwrap_or(0)));
        let cmdline =
            String::from_utf8_lossy(&std::fs::read(entry.path().join("cmdline")).unwrap_or_default()).into_owned();
        // runsc's sandbox and gofer name the id (as a word, or in a path).
        let named = cmdline.match_indices("sbx_").find_map(|(at, _)| {
            let candidate = cmdline.get(at..at + ids.first().map_or(0, String::len))?;
            wanted.contains(candidate).then(|| candidate.to_string())
        });
        if let Some(id) = named {
            owner.insert(pid, id);
        }
    }
    let mut grew = true;
    while grew {
        grew = false;
        for &(pid, ppid) in &parent {
            if !owner.contains_key(&pid) {
                if let Some(id) = owner.get(&ppid).cloned() {
                    owner.insert(pid, id);
                    grew = true;
                }
            }
        }
    }
    let mut pss: HashMap<String, u64> = HashMap::new();
    for (pid, id) in owner {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
        let kib: u64 = text
            .lines()
            .find(|l| l.starts_with("Pss:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0);
        *pss.entry(id).or_default() += kib << 10;
    }
    pss
}

/// MemAvailable from /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
}
