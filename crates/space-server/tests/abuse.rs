//! The abuse suite: code inside a sandbox, and callers of the API, trying
//! to get out, see what is not theirs, or take the host down. Each attempt
//! must fail and the host must stay healthy. It prints
//! `abuse attempts: N, got through: M` and fails unless M is 0.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::json;
use space_testkit::TestDataDir;

struct Suite {
    attempts: Vec<(String, Result<(), String>)>,
}

impl Suite {
    /// Records one attempt: `held` is true when the defence held.
    fn check(&mut self, name: &str, held: bool, evidence: impl std::fmt::Display) {
        let outcome = if held { Ok(()) } else { Err(evidence.to_string()) };
        eprintln!("{} {name}", if held { "held:" } else { "GOT THROUGH:" });
        self.attempts.push((name.to_string(), outcome));
    }
}

/// Runs a shell command in the sandbox and returns (stdout, stderr, exit code).
fn sh(server: &TestServer, id: &str, cmd: &str) -> (String, String, i64) {
    let answer = server.exec(id, json!({"cmd": cmd, "timeout_s": 60}));
    (
        answer["stdout"].as_str().unwrap_or("").to_string(),
        answer["stderr"].as_str().unwrap_or("").to_string(),
        answer["result"]["exit_code"].as_i64().unwrap_or(-1),
    )
}

fn py(server: &TestServer, id: &str, code: &str) -> String {
    let answer = server.exec(id, json!({"argv": ["python3", "-c", code], "timeout_s": 60}));
    format!("{}{}", answer["stdout"].as_str().unwrap_or(""), answer["stderr"].as_str().unwrap_or(""))
}

#[test]
fn abuse_attempts_all_fail_and_the_host_stays_healthy() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    server.platform.max_output_bytes.store(8 << 20, std::sync::atomic::Ordering::Relaxed);
    let mut suite = Suite { attempts: Vec::new() };
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
    let auth = format!("Bearer {}", server.key);
    let headers = [("Authorization", auth.as_str())];
    let (status, body) = server.raw(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/../../../../..{}", host_file.display()),
        &headers,
        None,
    );
    suite.check(
        "read a host file through the files API with ..",
        !body.contains("host secret"),
        format!("{status} {body}"),
    );
    sh(&server, &id, "ln -sfn / /root/rootlink; ln -sfn /proc/1/root /root/procroot");
    let (status, body) = server.raw(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/root/rootlink{}", host_file.display()),
        &headers,
        None,
    );
    let (status2, body2) = server.raw(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/root/procroot{}", host_file.display()),
        &headers,
        None,
    );
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
    let status = ureq::put(&format!("{}/v1/sandboxes/{id}/files?path=/root&format=tar", server.url))
        .set("Authorization", &auth)
        .send_bytes(&archive)
        .map(|r| r.status())
        .unwrap_or_else(|e| match e {
            ureq::Error::Status(code, _) => code,
            other => panic!("{other}"),
        });
    let inside = sh(&server, &id, &format!("ls /tmp/{marker}-tar 2>&1")).0;
    suite.check(
        "unpack a tar with ../ entries through the files API",
        status == 400
            && inside.contains("No such file")
            && !std::path::Path::new(&format!("/tmp/{marker}-tar")).exists(),
        status,
    );

    // --- The API as a caller without a valid key ---
    let (status, _) = server.raw("GET", "/v1/sandboxes", &[("Authorization", "Bearer space_guess")], None);
    suite.check("call the API with a guessed key", status == 401, status);
    let (_, b_key) = space_server::tenants::create_key(&server.platform.store, "intruder", None).unwrap();
    let (status, _) = server.call_as(&b_key, "GET", &format!("/v1/sandboxes/{id}"), None);
    let (status2, _) = server.call_as(&b_key, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "id"})));
    suite.check("reach another tenant's sandbox", status == 404 && status2 == 404, format!("{status} {status2}"));
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
    let (status, _) = server.raw("GET", &format!("/v1/sandboxes/sbx_{}", "a".repeat(5000)), &headers, None);
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
    let (status, health) = server.raw("GET", "/v1/health", &[], None);
    suite.check("take the server down", status == 200, &health);

    // The tally.
    let got_through: Vec<&(String, Result<(), String>)> = suite.attempts.iter().filter(|(_, r)| r.is_err()).collect();
    println!("abuse attempts: {}, got through: {}", suite.attempts.len(), got_through.len());
    eprintln!("abuse attempts: {}, got through: {}", suite.attempts.len(), got_through.len());
    drop(listener);
    let _ = std::fs::remove_file(&host_file);
    assert!(suite.attempts.len() >= 25, "the suite tries at least 25 things");
    assert!(got_through.is_empty(), "got through: {got_through:#?}");
}
