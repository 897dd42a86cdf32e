//! `sudo` in a gVisor sandbox (decision 034): gVisor honours no setuid bit,
//! so the sandbox's `sudo` asks the agent, which checks the caller's
//! credentials. Real runsc sandboxes from the base template, as `user`.

mod common;

use common::TestServer;
use serde_json::{json, Value};
use space_testkit::TestDataDir;

/// Asks the agent directly, claiming uid 0 in the credentials passed.
const FORGE: &str = r#"
import json, os, socket, struct
body = json.dumps({"command": ["id", "-u"], "env": [], "cwd": "/"}).encode()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("/run/space-sudo.sock")
fds = struct.pack("3i", 0, 1, 2)
creds = struct.pack("3i", os.getpid(), 0, 0)
try:
    s.sendmsg([struct.pack(">I", len(body)) + body],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds), (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
except PermissionError:
    print("refused")
else:
    print("sent:", s.makefile().readline().strip())
"#;

fn run(server: &TestServer, id: &str, user: &str, cmd: &str) -> Value {
    server.exec(id, json!({"cmd": cmd, "user": user}))
}

fn exit_code(ran: &Value) -> i64 {
    ran["result"]["exit_code"].as_i64().unwrap_or_else(|| panic!("no exit code: {ran}"))
}

#[test]
fn sudo_raises_members_of_group_sudo_and_refuses_everyone_else() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    // Templates built before the account existed lack it; either way
    // `user` is in group sudo, `grantee` is granted by a sudoers.d file as
    // the template build writes it, and `plain` is neither.
    let setup = server.exec(
        &id,
        json!({"cmd": "set -e; id -u user >/dev/null 2>&1 || useradd -m -s /bin/bash user; usermod -aG sudo user; \
                useradd -m -s /bin/bash plain; useradd -m -s /bin/bash grantee; mkdir -p /etc/sudoers.d; \
                echo 'grantee ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/grantee; chmod 0440 /etc/sudoers.d/grantee"}),
    );
    assert_eq!(exit_code(&setup), 0, "{setup}");

    let which = run(&server, &id, "user", "command -v sudo");
    assert_eq!(which["stdout"], "/usr/local/bin/sudo\n", "the shim comes first on PATH: {which}");

    let root = run(&server, &id, "user", "id -u; sudo id -u");
    assert_eq!((root["stdout"].as_str(), exit_code(&root)), (Some("1000\n0\n"), 0), "{root}");

    let back = run(&server, &id, "user", "sudo -u user id -un; sudo -n -u plain -- id -un");
    assert_eq!(back["stdout"], "user\nplain\n", "{back}");

    let piped =
        run(&server, &id, "user", "printf 'one\\ntwo\\n' | sudo cat; echo done | sudo -E tee /root/by-user >/dev/null");
    assert_eq!(piped["stdout"], "one\ntwo\n", "stdin reaches the command: {piped}");
    let owned = run(&server, &id, "root", "stat -c %U /root/by-user; cat /root/by-user");
    assert_eq!(owned["stdout"], "root\ndone\n", "{owned}");

    let failed = run(&server, &id, "user", "sudo sh -c 'echo out; echo err >&2; exit 7'");
    assert_eq!(
        (exit_code(&failed), failed["stdout"].as_str(), failed["stderr"].as_str()),
        (7, Some("out\n"), Some("err\n"))
    );
    let killed = run(&server, &id, "user", "sudo sh -c 'kill -TERM $$'; echo $?");
    assert_eq!(killed["stdout"], "143\n", "a signal's end is 128 + its number: {killed}");
    let missing = run(&server, &id, "user", "sudo no-such-command-here");
    assert_eq!(exit_code(&missing), 1, "{missing}");
    assert!(missing["stderr"].as_str().unwrap().contains("no-such-command-here: command not found"), "{missing}");

    let env = run(
        &server,
        &id,
        "user",
        "cd /tmp && FOO=1 sudo sh -c 'echo \"[$FOO]\" $HOME $USER $SUDO_USER $(pwd)'; FOO=2 sudo -E sh -c 'echo $FOO $HOME'",
    );
    assert_eq!(env["stdout"], "[] /root root user /tmp\n2 /home/user\n", "sudo's environment rules: {env}");
    let login = run(&server, &id, "user", "sudo -i pwd; sudo -i -u plain sh -c 'echo $HOME'");
    assert_eq!(login["stdout"], "/root\n/home/plain\n", "{login}");

    // Ctrl-C reaches the command: a background job (its SIGINT ignored by
    // the shell) still passes it on.
    let interrupted = run(
        &server,
        &id,
        "user",
        "sudo sleep 31 & job=$!; for i in $(seq 400); do pgrep -f '^sleep 31$' >/dev/null && break; sleep 0.05; done; \
         kill -INT $job; wait $job; echo $?",
    );
    assert_eq!(interrupted["stdout"], "130\n", "{interrupted}");

    let granted = run(&server, &id, "grantee", "sudo whoami");
    assert_eq!(granted["stdout"], "root\n", "a NOPASSWD: ALL sudoers rule grants: {granted}");

    let refused = run(&server, &id, "plain", "sudo id -u; echo $?; sudo -u user id");
    assert_eq!(refused["stdout"], "1\n", "{refused}");
    let stderr = refused["stderr"].as_str().unwrap();
    assert_eq!(stderr.matches("plain is not in the sudoers file").count(), 2, "{refused}");
    assert_eq!(exit_code(&refused), 1);
    let nothing = run(&server, &id, "root", "test -e /root/by-plain && echo there || echo absent");
    assert_eq!(nothing["stdout"], "absent\n");

    // Claiming root's credentials is the kernel's to refuse.
    let forged = server.exec(&id, json!({"argv": ["python3", "-c", FORGE], "user": "plain"}));
    assert_eq!(forged["stdout"], "refused\n", "{forged}");

    // Options that could be misread are refused by name.
    let unsupported = run(&server, &id, "user", "sudo -l");
    assert_eq!(exit_code(&unsupported), 1);
    assert!(unsupported["stderr"].as_str().unwrap().contains("-l is not supported"), "{unsupported}");
}

/// What sudo starts belongs to the caller's command: killing the command
/// ends it too.
#[test]
fn killing_a_command_ends_what_it_ran_with_sudo() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let setup =
        server.exec(&id, json!({"cmd": "id -u user >/dev/null 2>&1 || useradd -m user; usermod -aG sudo user"}));
    assert_eq!(exit_code(&setup), 0, "{setup}");
    let started = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": "sudo sh -c 'sleep 33 & exec sleep 34'", "user": "user"})),
    );
    let command = started["command"]["id"].as_str().unwrap_or_else(|| panic!("{started}")).to_string();
    let running = server.exec(
        &id,
        json!({"cmd": "for i in $(seq 400); do pgrep -f '^sleep 3[34]$' | wc -l | grep -qx 2 && exit 0; sleep 0.05; done; exit 1"}),
    );
    assert_eq!(exit_code(&running), 0, "both sleeps run as root: {running}");
    let (status, body) = server.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/commands/{command}/signal"),
        &[("Authorization", &format!("Bearer {}", server.key)), ("Content-Type", "application/json")],
        Some(r#"{"signal":"KILL"}"#),
    );
    assert_eq!(status, 204, "{body}");
    let gone = server.exec(
        &id,
        json!({"cmd": "for i in $(seq 400); do pgrep -f '^sleep 3[34]$' >/dev/null || exit 0; sleep 0.05; done; exit 1"}),
    );
    assert_eq!(exit_code(&gone), 0, "the kill reached what sudo started: {gone}");
}
