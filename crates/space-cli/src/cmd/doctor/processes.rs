//! `space doctor`'s "processes": for the root helper and the server, what
//! the kernel says each may do (user, effective capabilities,
//! no_new_privs, seccomp), the kernel's Landlock, and which untrusted
//! bytes each reads — the table SECURITY.md answers with.

use std::fmt::Write as _;

use space_engine::privsep::confine::{self, Status};

/// A role of `space` this section reports on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Helper,
    Server,
}

impl Role {
    const ALL: [Role; 2] = [Role::Helper, Role::Server];

    fn name(self) -> &'static str {
        match self {
            Role::Helper => "helper",
            Role::Server => "server",
        }
    }

    /// What untrusted input a process of this role parses.
    fn reads(self) -> &'static str {
        match self {
            Role::Helper => {
                "the typed requests of the unprivileged server on its socket; the image archives it \
                 passes for template imports go unread to a confined importer child (root with only \
                 cap_chown, cap_dac_override, cap_fowner and cap_fsetid, no_new_privs, seccomp, \
                 Landlock, the build dir as its root)"
            }
            Role::Server => {
                "HTTP, WebSocket and multipart bodies, tar and OCI archives, E2B Connect frames, \
                 egress request heads and TLS, agent frames, cluster peers"
            }
        }
    }

    /// The role of a process from its command line: `space helper`, or
    /// `space serve` / `space node` (a control plane is `serve --cluster`).
    fn of(argv: &[&str]) -> Option<Role> {
        let program = argv.first()?.rsplit('/').next()?;
        if program != "space" {
            return None;
        }
        match *argv.get(1)? {
            "helper" => Some(Role::Helper),
            "serve" | "node" => Some(Role::Server),
            _ => None,
        }
    }
}

/// Capability names by bit (linux/capability.h).
const CAPABILITIES: [&str; 41] = [
    "cap_chown",
    "cap_dac_override",
    "cap_dac_read_search",
    "cap_fowner",
    "cap_fsetid",
    "cap_kill",
    "cap_setgid",
    "cap_setuid",
    "cap_setpcap",
    "cap_linux_immutable",
    "cap_net_bind_service",
    "cap_net_broadcast",
    "cap_net_admin",
    "cap_net_raw",
    "cap_ipc_lock",
    "cap_ipc_owner",
    "cap_sys_module",
    "cap_sys_rawio",
    "cap_sys_chroot",
    "cap_sys_ptrace",
    "cap_sys_pacct",
    "cap_sys_admin",
    "cap_sys_boot",
    "cap_sys_nice",
    "cap_sys_resource",
    "cap_sys_time",
    "cap_sys_tty_config",
    "cap_mknod",
    "cap_lease",
    "cap_audit_write",
    "cap_audit_control",
    "cap_setfcap",
    "cap_mac_override",
    "cap_mac_admin",
    "cap_syslog",
    "cap_wake_alarm",
    "cap_block_suspend",
    "cap_audit_read",
    "cap_perfmon",
    "cap_bpf",
    "cap_checkpoint_restore",
];

/// A capability set by name ("none" when empty); bits past the table's
/// (a newer kernel's) by number.
fn capability_names(set: u64) -> String {
    let names: Vec<String> = (0..64)
        .filter(|bit| set & (1u64 << bit) != 0)
        .map(|bit| CAPABILITIES.get(bit).map_or_else(|| format!("cap_{bit}"), |name| name.to_string()))
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(" ")
    }
}

fn seccomp_mode(status: &Status) -> String {
    match status.seccomp {
        0 => "0 (disabled)".into(),
        1 => "1 (strict)".into(),
        2 => format!("2 (filter, {} filters)", status.seccomp_filters),
        other => format!("{other} (unknown)"),
    }
}

/// SPACE's processes on this host by role. Neither process writes a pid
/// file, so they are found by their command lines in /proc (readable to
/// anyone, like the status files read below).
/// Each with its command line.
fn find() -> Vec<(Role, u32, Vec<String>)> {
    let mut found: Vec<(Role, u32, Vec<String>)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            let argv: Vec<&str> = cmdline.split('\0').collect();
            let role = Role::of(&argv)?;
            Some((role, pid, argv.iter().map(|a| a.to_string()).collect()))
        })
        .collect();
    found.sort_unstable_by_key(|(role, pid, _)| (role.name(), *pid));
    found
}

/// What a confined server recorded of its own Landlock ruleset
/// (`state/confined.json` of the data dir on its command line), when the
/// record is that process's: Landlock leaves no trace outside a process.
fn recorded_landlock(pid: u32, argv: &[String]) -> Option<String> {
    let at = argv.iter().position(|a| a == "--data-dir");
    let data_dir = match at.and_then(|at| argv.get(at + 1)) {
        Some(dir) => std::path::PathBuf::from(dir),
        None => argv
            .iter()
            .find_map(|a| a.strip_prefix("--data-dir="))
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| crate::cli::DEFAULT_DATA_DIR.into()),
    };
    let path = space_host::datadir::state_dir(&data_dir).join(CONFINED_RECORD);
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    (record["pid"].as_u64() == Some(u64::from(pid))).then(|| record["landlock"].as_str().map(str::to_string))?
}

/// Where `space serve --helper-socket` records what its confinement achieved.
pub(crate) const CONFINED_RECORD: &str = "confined.json";

fn user_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(uid.into()) {
        Ok(Some(user)) => format!("{} (uid {uid})", user.name),
        _ => format!("uid {uid}"),
    }
}

/// The section's text.
#[cfg(test)]
fn render(found: &[(Role, u32)], landlock_abi: Option<i32>) -> String {
    render_with(found, landlock_abi, &[])
}

/// [`render`], with what confined servers recorded of their Landlock.
fn render_with(found: &[(Role, u32)], landlock_abi: Option<i32>, recorded: &[(u32, String)]) -> String {
    let landlock = match landlock_abi {
        Some(abi) => format!("kernel ABI {abi} (whether a process is restricted is not visible from outside it)"),
        None => "not offered by this kernel".into(),
    };
    let mut out = String::from("processes\n");
    let detail = |out: &mut String, key: &str, value: &str| {
        let _ = writeln!(out, "            {key:<13} {value}");
    };
    for role in Role::ALL {
        let pids: Vec<u32> = found.iter().filter(|(r, _)| *r == role).map(|&(_, pid)| pid).collect();
        if pids.is_empty() {
            let _ = writeln!(out, "  {:<9} not running", role.name());
            detail(&mut out, "reads", role.reads());
        }
        for pid in pids {
            let status = match confine::status_of(pid) {
                Ok(status) => status,
                Err(err) => {
                    let _ = writeln!(out, "  {:<9} pid {pid}: its status does not read ({err})", role.name());
                    continue;
                }
            };
            let _ = writeln!(out, "  {:<9} pid {pid}", role.name());
            detail(&mut out, "user", &user_name(status.uid));
            detail(&mut out, "capabilities", &capability_names(status.cap_effective));
            detail(&mut out, "no_new_privs", if status.no_new_privs { "yes" } else { "no" });
            detail(&mut out, "seccomp", &seccomp_mode(&status));
            match recorded.iter().find(|(at, _)| *at == pid) {
                Some((_, how)) => detail(&mut out, "landlock", &format!("enforced ({how}), as the process recorded")),
                None => detail(&mut out, "landlock", &landlock),
            }
            detail(&mut out, "reads", role.reads());
        }
    }
    out
}

pub(crate) fn report() {
    let found = find();
    let recorded: Vec<(u32, String)> = found
        .iter()
        .filter(|(role, _, _)| *role == Role::Server)
        .filter_map(|(_, pid, argv)| Some((*pid, recorded_landlock(*pid, argv)?)))
        .collect();
    let found: Vec<(Role, u32)> = found.into_iter().map(|(role, pid, _)| (role, pid)).collect();
    print!("{}", render_with(&found, confine::landlock_abi(), &recorded));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_come_from_the_command_line() {
        assert_eq!(Role::of(&["/usr/local/bin/space", "helper", "--socket", "x"]), Some(Role::Helper));
        assert_eq!(Role::of(&["space", "serve", "--dev"]), Some(Role::Server));
        assert_eq!(Role::of(&["./space", "node"]), Some(Role::Server));
        assert_eq!(Role::of(&["space", "doctor"]), None);
        assert_eq!(Role::of(&["/bin/namespace", "serve"]), None);
        assert_eq!(Role::of(&["vim", "space", "helper"]), None);
        assert_eq!(Role::of(&[]), None);
    }

    #[test]
    fn capabilities_read_as_names() {
        assert_eq!(capability_names(0), "none");
        assert_eq!(capability_names(1 | 1 << 21), "cap_chown cap_sys_admin");
        assert_eq!(capability_names(1 << 40 | 1 << 41), "cap_checkpoint_restore cap_41");
    }

    #[test]
    fn a_process_not_running_is_named_with_what_it_would_read() {
        let text = render(&[], None);
        assert!(text.contains("  helper    not running\n"), "{text}");
        assert!(text.contains("  server    not running\n"), "{text}");
        assert!(text.contains("typed requests"), "{text}");
    }

    #[test]
    fn this_process_reads_as_a_server() {
        let text = render(&[(Role::Server, std::process::id())], Some(3));
        let euid = nix::unistd::geteuid().as_raw();
        assert!(text.contains(&format!("  server    pid {}\n", std::process::id())), "{text}");
        assert!(text.contains(&format!("(uid {euid})")), "{text}");
        assert!(text.contains("kernel ABI 3"), "{text}");
        assert!(text.contains("E2B Connect frames"), "{text}");
    }
}
