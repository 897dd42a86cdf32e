//! `space setup`: make this host ready, idempotently.

mod account;
mod units;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use space_host::datadir::{ensure_btrfs, DataDir};
use space_host::template::{build_debian, known_packages, DebianBuild, BASE_TEMPLATE};

use self::account::{Account, Changes};
use self::units::Units;
use crate::cli::SetupArgs;

pub fn run(args: SetupArgs) -> Result<()> {
    let started = Instant::now();
    let say = |line: &str| eprintln!("setup: {line}");
    if args.privileges_only {
        let data = DataDir::open(&args.data_dir)?;
        return privileges(&data, &args);
    }
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
    privileges(&data, &args)?;
    say(&format!("ready in {:.1}s", started.elapsed().as_secs_f64()));
    Ok(())
}

/// Builds the template `name` (one `space setup` knows) unless it is there
/// with the packages and the account this version of `space` puts in it
/// (a newer list, or a root without the `user` account, makes a new
/// version; sandboxes of the old one keep it).
fn ensure_template(data: &DataDir, args: &SetupArgs, name: &str, say: impl Fn(&str)) -> Result<()> {
    let packages = known_packages(name).with_context(|| format!("no template named {name} is known to setup"))?;
    if let Some(template) = data.template(name) {
        let built_with = template.meta.source["debian"]["packages"].as_array().map(|list| {
            list.iter().filter_map(|p| p.as_str()).map(str::to_string).collect::<std::collections::BTreeSet<_>>()
        });
        let wanted: std::collections::BTreeSet<String> = packages.iter().map(|p| p.to_string()).collect();
        let home = template.rootfs().join("home").join(space_host::template::DEFAULT_ACCOUNT);
        let account = std::fs::symlink_metadata(home).is_ok_and(|meta| meta.is_dir());
        if built_with.is_none_or(|built| built == wanted) && account {
            say(&format!("template {name}: version {} present", template.meta.version));
            return Ok(());
        }
        say(&format!(
            "template {name}: version {} lacks packages or the {} account this version adds; building anew",
            template.meta.version,
            space_host::template::DEFAULT_ACCOUNT
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

/// The least-privilege part (design 35, §6): the user, the paths it owns,
/// the run dir of the helper's socket and, with `--systemd`, one unit per
/// process. Says what it changed, or that nothing needed to.
fn privileges(data: &DataDir, args: &SetupArgs) -> Result<()> {
    for (path, what) in [(data.root(), "--data-dir"), (args.run_dir.as_path(), "--run-dir")] {
        anyhow::ensure!(
            units::plain(path),
            "{what} {} holds characters a unit file would read otherwise: pick a plain absolute path",
            path.display()
        );
    }
    let mut changes = Changes::default();
    let user = account::ensure_user(&args.user, data.root(), &mut changes)?;
    // The user crosses these to reach its own and may write neither.
    account::crossable_not_writable(data.root(), &user, &mut changes)?;
    account::crossable_not_writable(&data.run_dir(), &user, &mut changes)?;
    for dir in owned_dirs(data) {
        account::ensure_dir(&dir, 0o700, user.uid, user.gid, &mut changes)?;
        account::own_tree(&dir, user.uid, user.gid, &mut changes)?;
    }
    for key in [data.secrets_key_path(), data.dev_key_path(), api_key_path(data)] {
        account::private_file(&key, &mut changes)?;
    }
    account::ensure_dir(&args.run_dir, 0o750, 0, user.gid, &mut changes)?;
    if args.systemd {
        systemd(data, args, &user, &mut changes)?;
    }
    match changes.0.len() {
        0 => eprintln!("setup: user {} and what it owns: nothing changed", user.name),
        n => eprintln!("setup: user {} and what it owns: {n} changes", user.name),
    }
    Ok(())
}

/// What the server writes (design 35, §4), all the user's and no one
/// else's: its state, build logs and uploads in flight.
fn owned_dirs(data: &DataDir) -> [PathBuf; 3] {
    [data.state_dir(), data.logs_dir(), data.run_dir().join("uploads")]
}

/// The operator's API key the server's unit passes with `--api-key-file`.
fn api_key_path(data: &DataDir) -> PathBuf {
    data.state_dir().join("api-key")
}

fn systemd(data: &DataDir, args: &SetupArgs, user: &Account, changes: &mut Changes) -> Result<()> {
    let binary = std::env::current_exe().and_then(std::fs::canonicalize).context("locating the space binary")?;
    let agent_bin = args.engine.agent_bin().ok();
    let firecracker_bin = space_engine::firecracker::find_firecracker(None);
    for path in std::iter::once(&binary).chain(agent_bin.as_ref()).chain(firecracker_bin.as_ref()) {
        anyhow::ensure!(units::plain(path), "{} cannot stand in a unit file: move it", path.display());
        // The units hide these from both processes.
        if ["/home", "/root", "/tmp", "/var/tmp", "/run/user"].iter().any(|hidden| path.starts_with(hidden)) {
            eprintln!(
                "setup: WARNING: {} is under a directory the units hide (ProtectHome, PrivateTmp): \
                 install it elsewhere, such as /usr/local/bin, and run setup from there",
                path.display()
            );
        }
    }
    let api_key = api_key_path(data);
    if !api_key.exists() {
        space_host::datadir::create_once(&api_key, 0o600, || {
            let mut bytes = [0u8; 24];
            getrandom::getrandom(&mut bytes).map_err(std::io::Error::other)?;
            Ok(format!("space_op_{}\n", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()).into_bytes())
        })
        .with_context(|| format!("making the operator's API key {}", api_key.display()))?;
        std::os::unix::fs::lchown(&api_key, Some(user.uid), Some(user.gid))
            .with_context(|| format!("chown {}", api_key.display()))?;
        changes.note(format!("{}: the operator's API key, made (0600, {})", api_key.display(), user.name));
    }
    let mut server_writes = owned_dirs(data).to_vec();
    server_writes.push(args.run_dir.clone());
    let units = Units {
        binary,
        data_dir: data.root().to_path_buf(),
        run_dir: args.run_dir.clone(),
        user: user.name.clone(),
        uid: user.uid,
        group: user.group.clone(),
        agent_bin,
        firecracker_bin,
        api_key_file: api_key,
        server_writes,
    };
    std::fs::create_dir_all(&args.unit_dir).with_context(|| format!("creating {}", args.unit_dir.display()))?;
    std::fs::create_dir_all(&args.tmpfiles_dir).with_context(|| format!("creating {}", args.tmpfiles_dir.display()))?;
    let mut wrote = false;
    for (name, text) in
        [(units::HELPER_UNIT, units::helper_unit(&units)), (units::SERVER_UNIT, units::server_unit(&units))]
    {
        wrote |= account::write_if_changed(&args.unit_dir.join(name), &text, changes)?;
    }
    account::write_if_changed(
        &args.tmpfiles_dir.join(units::TMPFILES_NAME),
        &units::tmpfiles(&args.run_dir, &user.group),
        changes,
    )?;
    // Only the units systemd itself reads are loaded; `--unit-dir`
    // elsewhere is someone's copy.
    if wrote && args.unit_dir == Path::new("/etc/systemd/system") && Path::new("/run/systemd/system").is_dir() {
        let reload = std::process::Command::new("systemctl").arg("daemon-reload").status();
        if !reload.is_ok_and(|s| s.success()) {
            eprintln!("setup: WARNING: systemctl daemon-reload failed: run it before starting the units");
        }
    }
    eprintln!(
        "setup: start both with `systemctl enable --now {} {}`; clients use the key in {}",
        units::HELPER_UNIT,
        units::SERVER_UNIT,
        units.api_key_file.display()
    );
    Ok(())
}
