//! The systemd units `space setup --systemd` writes: one per process, each
//! with only what that process needs. Rendered from code so a test reads
//! exactly what a host gets.

use std::path::{Path, PathBuf};

/// The helper's unit file name; the server's unit requires it by this name.
pub(crate) const HELPER_UNIT: &str = "space-helper.service";
pub(crate) const SERVER_UNIT: &str = "space.service";
/// The tmpfiles.d snippet that makes the run dir again after a reboot.
pub(crate) const TMPFILES_NAME: &str = "space.conf";

/// What the helper's request set needs of root (design 35, §6): runsc's
/// namespaces, mounts, chroot and cgroups, btrfs snapshots and quotas,
/// chown of template roots, the freezer and timer slack of root's tasks.
/// Anything else root could do is out of its bounding set.
pub(crate) const HELPER_CAPABILITIES: &[&str] = &[
    "CAP_SYS_ADMIN",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_KILL",
    "CAP_SYS_PTRACE",
    "CAP_SYS_NICE",
    "CAP_MKNOD",
    "CAP_SYS_CHROOT",
    "CAP_SYS_RESOURCE",
    "CAP_NET_ADMIN",
    "CAP_SETFCAP",
];

/// What both units are rendered from.
#[derive(Debug, Clone)]
pub(crate) struct Units {
    /// The `space` binary, absolute (systemd runs nothing by a relative path).
    pub(crate) binary: PathBuf,
    pub(crate) data_dir: PathBuf,
    /// The helper's socket lives here (`/run/space`).
    pub(crate) run_dir: PathBuf,
    pub(crate) user: String,
    pub(crate) uid: u32,
    /// The user's primary group.
    pub(crate) group: String,
    /// The statically linked agent, when setup found one: under systemd
    /// neither process has the environment a shell gave setup.
    pub(crate) agent_bin: Option<PathBuf>,
    /// The firecracker binary, when setup found one: the helper runs the
    /// microVMs and the server asks it for them.
    pub(crate) firecracker_bin: Option<PathBuf>,
    /// The operator's API key file the server reads.
    pub(crate) api_key_file: PathBuf,
    /// The paths the server may write: its own, all owned by `user`.
    pub(crate) server_writes: Vec<PathBuf>,
}

impl Units {
    pub(crate) fn helper_socket(&self) -> PathBuf {
        self.run_dir.join("helper.sock")
    }
}

/// `space-helper.service`: root, with only the helper's capabilities.
/// `KillMode=process` because runsc's sandboxes are its children: stopping
/// or restarting the helper must not kill every tenant's sandbox. Both
/// units wait for the data dir's mount when it has one systemd knows.
pub(crate) fn helper_unit(units: &Units) -> String {
    let mut exec = vec![
        arg(&units.binary),
        "helper".into(),
        "--data-dir".into(),
        arg(&units.data_dir),
        "--socket".into(),
        arg(&units.helper_socket()),
        "--allow-uid".into(),
        units.uid.to_string(),
    ];
    if let Some(agent) = &units.agent_bin {
        exec.extend(["--agent-bin".into(), arg(agent)]);
    }
    if let Some(firecracker) = &units.firecracker_bin {
        exec.extend(["--firecracker-bin".into(), arg(firecracker)]);
    }
    format!(
        "\
# Made by `space setup --systemd`; running it again rewrites this file.
[Unit]
Description=SPACE privileged helper (the engine's root work, for user {user} only)
RequiresMountsFor={data}

[Service]
Type=simple
ExecStart={exec}
CapabilityBoundingSet={caps}
ProtectSystem=strict
ReadWritePaths={data} {run} /sys/fs/cgroup
PrivateTmp=yes
ProtectHome=yes
Delegate=yes
KillMode=process
UMask=0077
Restart=on-failure

[Install]
WantedBy=multi-user.target
",
        user = units.user,
        exec = exec.join(" "),
        caps = HELPER_CAPABILITIES.join(" "),
        data = arg(&units.data_dir),
        run = arg(&units.run_dir),
    )
}

/// `space.service`: the process that reads every untrusted byte, as
/// `user` with no capability at all. `ProtectProc=` is not set: the
/// Firecracker engine, still in the server, reads its VMMs' /proc entries
/// (adoption); `SystemCallFilter=` is not set either, as the server
/// installs its own seccomp filter (`space_privsep::confine`), the same
/// with or without systemd.
pub(crate) fn server_unit(units: &Units) -> String {
    let mut exec = vec![
        arg(&units.binary),
        "serve".into(),
        "--data-dir".into(),
        arg(&units.data_dir),
        "--helper-socket".into(),
        arg(&units.helper_socket()),
        "--api-key-file".into(),
        arg(&units.api_key_file),
    ];
    if let Some(agent) = &units.agent_bin {
        exec.extend(["--agent-bin".into(), arg(agent)]);
    }
    if let Some(firecracker) = &units.firecracker_bin {
        exec.extend(["--firecracker-bin".into(), arg(firecracker)]);
    }
    let writes: Vec<String> = units.server_writes.iter().map(|p| arg(p)).collect();
    format!(
        "\
# Made by `space setup --systemd`; running it again rewrites this file.
[Unit]
Description=SPACE API server (unprivileged: user {user}, no capabilities)
Requires={helper}
After={helper} network-online.target
Wants=network-online.target
RequiresMountsFor={data}

[Service]
Type=simple
User={user}
Group={group}
ExecStart={exec}
CapabilityBoundingSet=
AmbientCapabilities=
NoNewPrivileges=yes
ProtectSystem=strict
ReadWritePaths={writes}
PrivateTmp=yes
PrivateDevices=yes
ProtectHome=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
MemoryDenyWriteExecute=yes
LockPersonality=yes
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
RemoveIPC=yes
UMask=0077
Restart=on-failure

[Install]
WantedBy=multi-user.target
",
        user = units.user,
        group = units.group,
        helper = HELPER_UNIT,
        exec = exec.join(" "),
        data = arg(&units.data_dir),
        writes = writes.join(" "),
    )
}

/// The tmpfiles.d line for the run dir: after a reboot `/run` is empty,
/// and the server (not root) could not make it.
pub(crate) fn tmpfiles(run_dir: &Path, group: &str) -> String {
    format!("# Made by `space setup --systemd`.\nd {} 0750 root {group} -\n", arg(run_dir))
}

/// A path as one word of a unit file. Setup refuses paths that would need
/// quoting (see [`plain`]), so none is quoted here.
fn arg(path: &Path) -> String {
    path.display().to_string()
}

/// Whether `path` can stand as one word in a unit or tmpfiles.d line: no
/// whitespace, quotes, backslash, `%` (a specifier) or `$` (a variable).
pub(crate) fn plain(path: &Path) -> bool {
    path.to_str().is_some_and(|p| p.starts_with('/') && !p.chars().any(|c| c.is_whitespace() || "\"'\\%$;".contains(c)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units() -> Units {
        Units {
            binary: "/usr/local/bin/space".into(),
            data_dir: "/var/lib/space".into(),
            run_dir: "/run/space".into(),
            user: "space".into(),
            uid: 998,
            group: "space".into(),
            agent_bin: Some("/usr/local/lib/space/space-agent".into()),
            firecracker_bin: None,
            api_key_file: "/var/lib/space/state/api-key".into(),
            server_writes: vec!["/var/lib/space/state".into(), "/run/space".into()],
        }
    }

    fn value<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
        unit.lines().filter_map(|l| l.strip_prefix(key)?.strip_prefix('=')).collect()
    }

    #[test]
    fn the_helper_runs_as_root_with_only_its_capabilities_and_keeps_sandboxes_on_restart() {
        let unit = helper_unit(&units());
        assert_eq!(
            value(&unit, "ExecStart"),
            ["/usr/local/bin/space helper --data-dir /var/lib/space --socket /run/space/helper.sock \
              --allow-uid 998 --agent-bin /usr/local/lib/space/space-agent"]
        );
        assert!(value(&unit, "User").is_empty(), "root");
        assert_eq!(value(&unit, "CapabilityBoundingSet"), [HELPER_CAPABILITIES.join(" ").as_str()]);
        assert!(!unit.contains("CAP_SYS_MODULE") && !unit.contains("CAP_NET_RAW"));
        assert_eq!(value(&unit, "KillMode"), ["process"]);
        assert_eq!(value(&unit, "RequiresMountsFor"), ["/var/lib/space"]);
        assert_eq!(value(&unit, "ReadWritePaths"), ["/var/lib/space /run/space /sys/fs/cgroup"]);
        for line in ["ProtectSystem=strict", "PrivateTmp=yes", "ProtectHome=yes", "Delegate=yes"] {
            assert!(unit.lines().any(|l| l == line), "{line}");
        }
    }

    /// Under systemd neither process has the shell's FIRECRACKER_BIN: both
    /// are told where the binary setup found is.
    #[test]
    fn both_units_name_the_firecracker_binary_setup_found() {
        let with = Units { firecracker_bin: Some("/usr/local/bin/firecracker".into()), ..units() };
        for unit in [helper_unit(&with), server_unit(&with)] {
            assert!(value(&unit, "ExecStart")[0].contains(" --firecracker-bin /usr/local/bin/firecracker"), "{unit}");
        }
        assert!(!value(&helper_unit(&units()), "ExecStart")[0].contains("firecracker"), "none found: none named");
    }

    #[test]
    fn the_server_has_no_capability_and_writes_only_its_own_paths() {
        let unit = server_unit(&units());
        assert_eq!(value(&unit, "User"), ["space"]);
        assert_eq!(value(&unit, "Requires"), [HELPER_UNIT]);
        assert_eq!(value(&unit, "RequiresMountsFor"), ["/var/lib/space"]);
        assert_eq!(value(&unit, "CapabilityBoundingSet"), [""]);
        assert_eq!(value(&unit, "AmbientCapabilities"), [""]);
        assert_eq!(value(&unit, "ReadWritePaths"), ["/var/lib/space/state /run/space"]);
        assert!(value(&unit, "ExecStart")[0]
            .contains(" serve --data-dir /var/lib/space --helper-socket /run/space/helper.sock"));
        for line in [
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "PrivateDevices=yes",
            "RestrictNamespaces=yes",
            "SystemCallArchitectures=native",
            "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
            "LockPersonality=yes",
        ] {
            assert!(unit.lines().any(|l| l == line), "{line}");
        }
    }

    #[test]
    fn only_plain_absolute_paths_go_into_a_unit() {
        assert!(plain(Path::new("/var/lib/space")));
        for bad in ["var/lib", "/a b", "/a%h", "/a$X", "/a\\b", "/a\"b", "/a\nb"] {
            assert!(!plain(Path::new(bad)), "{bad:?}");
        }
    }
}
