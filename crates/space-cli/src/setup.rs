//! `space setup`: make this host ready, idempotently.

use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use space_host::datadir::{ensure_btrfs, DataDir};
use space_host::template::{build_debian, known_packages, DebianBuild, BASE_TEMPLATE};

use crate::cli::SetupArgs;

pub fn run(args: SetupArgs) -> Result<()> {
    let started = Instant::now();
    let say = |line: &str| eprintln!("setup: {line}");
    if !args.skip_packages {
        space_host::packages::ensure_required(say).context("installing packages")?;
    }
    let what = ensure_btrfs(&args.data_dir, args.btrfs_image_gib).context("preparing the data dir")?;
    say(&format!("data dir: {what}"));
    let data = DataDir::open(&args.data_dir)?;
    if let Some(host) = data.space().image_host() {
        let (free, total) = data.disk_space();
        say(&format!(
            "data dir: a {} GiB sparse image on {}: {} GiB can still be written (the disk under it counts)",
            total >> 30,
            host.display(),
            free >> 30
        ));
    }
    let quotas = space_host::btrfs::enable_quotas(data.root()).context("turning btrfs quotas on")?;
    say(&format!("disk limits: btrfs {quotas:?} quotas"));
    let names = std::iter::once(BASE_TEMPLATE.to_string()).chain(args.with_templates.iter().cloned());
    for name in names {
        ensure_template(&data, &args, &name, say)?;
    }
    // Firecracker's guest: Debian's cloud kernel and an initramfs whose
    // /init is the agent (built on every host, so a move to hardware
    // virtualization finds it ready; the VMM tests boot it too).
    let agent = args.engine.agent_bin()?;
    let guest = space_host::guest::prepare(&data, &agent, &say).context("preparing the Firecracker guest")?;
    say(&format!(
        "guest kernel {} and initramfs: {}",
        guest.release,
        guest.kernel.parent().unwrap_or(data.root()).display()
    ));
    say(&format!("ready in {:.1}s", started.elapsed().as_secs_f64()));
    Ok(())
}

/// Builds the template `name` (one `space setup` knows) unless it is there
/// with the packages this version of `space` puts in it (a newer list
/// makes a new version; sandboxes of the old one keep it).
fn ensure_template(data: &DataDir, args: &SetupArgs, name: &str, say: impl Fn(&str)) -> Result<()> {
    let packages = known_packages(name).with_context(|| format!("no template named {name} is known to setup"))?;
    if let Some(template) = data.template(name) {
        let built_with = template.meta.source["debian"]["packages"].as_array().map(|list| {
            list.iter().filter_map(|p| p.as_str()).map(str::to_string).collect::<std::collections::BTreeSet<_>>()
        });
        let wanted: std::collections::BTreeSet<String> = packages.iter().map(|p| p.to_string()).collect();
        if built_with.is_none_or(|built| built == wanted) {
            say(&format!("template {name}: version {} present", template.meta.version));
            return Ok(());
        }
        say(&format!(
            "template {name}: version {} lacks packages this version adds; building anew",
            template.meta.version
        ));
    }
    let agent = args.engine.agent_bin()?;
    let bar = ProgressBar::new(4);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "setup: building template {name} [{{bar:20}}] {{pos}}/{{len}} {{elapsed}} {{wide_msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let build = DebianBuild {
        max_bytes: None,
        owner: None,
        engine: None,
        name: name.into(),
        suite: args.suite.clone(),
        packages: packages.iter().map(|p| p.to_string()).collect(),
        defaults: Default::default(),
        log: data.log_path(&format!("setup-{name}")),
        apt_cache: Some(data.apt_cache_dir()),
    };
    let built = build_debian(data, &build, &agent, |p| {
        bar.set_position(p.done);
        bar.set_message(p.step);
    });
    bar.finish_and_clear();
    let template = built.with_context(|| format!("building the {name} template (log: {})", build.log.display()))?;
    say(&format!("template {name}: built version {}", template.meta.version));
    Ok(())
}
