//! What developers run, in a sandbox of the default size (512 MiB), on real
//! runsc: a JDK, Go, Node, a C toolchain, git and Python from the
//! `polyglot` template (`space setup --with-template polyglot`, run by the
//! test command). Runtimes reserve far more address space than they use;
//! memory hogs are killed inside the sandbox while their neighbours go on;
//! `/tmp` is disk, not memory.

mod common;

use common::TestServer;
use serde_json::{json, Value};
use space_host::template::{BASE_TEMPLATE, POLYGLOT_TEMPLATE};
use space_testkit::TestDataDir;

fn polyglot() -> TestDataDir {
    TestDataDir::with_templates(&[BASE_TEMPLATE, POLYGLOT_TEMPLATE])
}

/// Runs `cmd` with `sh -c` and insists it exits 0; returns its stdout.
fn run_ok(server: &TestServer, id: &str, cmd: &str) -> String {
    let done = server.exec(id, json!({"cmd": cmd, "timeout_s": 600}));
    assert_eq!(done["result"]["exit_code"], 0, "`{cmd}` failed: {done}");
    done["stdout"].as_str().unwrap().to_string()
}

fn put(server: &TestServer, id: &str, path: &str, text: &str) {
    let auth = format!("Bearer {}", server.key);
    let (status, answer) =
        server.raw("PUT", &format!("/v1/sandboxes/{id}/files?path={path}"), &[("Authorization", &auth)], Some(text));
    assert_eq!(status, 201, "writing {path}: {answer}");
}

#[test]
fn java_go_node_c_python_and_git_run_in_a_default_sandbox() {
    let data = polyglot();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": POLYGLOT_TEMPLATE}));
    let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(sandbox["memory_mib"], 512, "the default size: {sandbox}");

    // Java: the JVM sizes its heap from the machine and reserves address
    // space for it up front.
    let version = server.exec(&id, json!({"argv": ["java", "-version"]}));
    assert_eq!(version["result"]["exit_code"], 0, "{version}");
    assert!(version["stderr"].as_str().unwrap().contains("openjdk"), "{version}");
    put(
        &server,
        &id,
        "/root/java/Hello.java",
        "public class Hello { public static void main(String[] a) {\n\
         long sum = 0; for (int i = 0; i < 1000; i++) sum += i;\n\
         System.out.println(\"java says \" + sum); } }\n",
    );
    assert_eq!(run_ok(&server, &id, "cd /root/java && javac Hello.java && java Hello"), "java says 499500\n");

    // Go: `go build`, then the binary (both reserve large arenas).
    put(
        &server,
        &id,
        "/root/hello-go/main.go",
        "package main\nimport \"fmt\"\nfunc main() { m := map[int]int{}; for i := 0; i < 1000; i++ { m[i] = i * i }\n\
         fmt.Println(\"go says\", len(m), m[999]) }\n",
    );
    let go = "cd /root/hello-go && go mod init example.test/hello >/dev/null 2>&1 && go build -o hello . && ./hello";
    assert_eq!(run_ok(&server, &id, go), "go says 1000 998001\n");

    // Node.
    let node = run_ok(&server, &id, "node -e 'console.log(\"node says\", [1,2,3].map(x => x * 2).join(\",\"))'");
    assert_eq!(node, "node says 2,4,6\n");

    // C.
    put(&server, &id, "/root/c/hello.c", "#include <stdio.h>\nint main(void) { printf(\"c says %d\\n\", 6 * 7); }\n");
    assert_eq!(run_ok(&server, &id, "cd /root/c && gcc -O2 -o hello hello.c && ./hello"), "c says 42\n");
    assert_eq!(run_ok(&server, &id, "cd /root/c && printf 'all:\\n\\t@echo made\\n' > Makefile && make"), "made\n");

    // Python reserving 8 GiB of address space (never touching most of it),
    // as CPython's own test_mmap does.
    let reserve = "import mmap\nm = mmap.mmap(-1, 8 << 30)\nm[0] = 1\nm[(8 << 30) - 1] = 2\n\
                   print('reserved', len(m) >> 30, 'GiB', m[0] + m[(8 << 30) - 1])";
    let reserved = server.exec(&id, json!({"argv": ["python3", "-c", reserve]}));
    assert_eq!(reserved["stdout"], "reserved 8 GiB 3\n", "{reserved}");

    // git: a repository, commits, a branch, a log.
    let git = "cd /root && git init -q -b main repo && cd repo && git config user.email dev@example.test \
               && git config user.name dev && echo one > f && git add f && git commit -qm one \
               && git checkout -qb topic && echo two >> f && git commit -qam two && git checkout -q main \
               && git merge -q topic && git log --format=%s | tr '\\n' ' ' && git rev-list --count HEAD";
    assert_eq!(run_ok(&server, &id, git), "two one 2\n");

    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"], "running");
    server.delete_sandbox(&id);
}

/// Starts `cmd` and returns its command id.
fn start(server: &TestServer, id: &str, cmd: &str) -> String {
    let (status, started) =
        server.call("POST", &format!("/v1/sandboxes/{id}/commands"), Some(json!({"cmd": cmd, "timeout_s": 300})));
    assert_eq!(status, 201, "{started}");
    started["command"]["id"].as_str().unwrap().to_string()
}

fn wait_result(server: &TestServer, id: &str, cid: &str) -> Value {
    let command = space_testkit::wait_for("a command to end", space_testkit::PATIENCE * 5, || {
        let command = server.ok("GET", &format!("/v1/sandboxes/{id}/commands/{cid}?wait=30"), None);
        (command["state"] == "exited").then_some(command)
    });
    command["result"].clone()
}

#[test]
fn memory_hogs_in_python_and_java_are_killed_inside_while_a_neighbour_finishes() {
    let data = polyglot();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": POLYGLOT_TEMPLATE}));
    put(
        &server,
        &id,
        "/root/Hog.java",
        "import java.util.*;\npublic class Hog { public static void main(String[] a) {\n\
         List<byte[]> kept = new ArrayList<>();\n\
         while (true) { byte[] b = new byte[16 << 20]; Arrays.fill(b, (byte) 1); kept.add(b);\n\
         System.out.println(\"held \" + kept.size() * 16 + \" MiB\"); } } }\n",
    );
    run_ok(&server, &id, "cd /root && javac Hog.java");

    let hogs = [
        ("python", "python3 -c 'x = bytearray(2 << 30); print(len(x))'"),
        // The JVM may grow its heap to 2 GiB: far more than the sandbox has.
        ("java", "cd /root && java -Xmx2g Hog"),
    ];
    for (name, hog) in hogs {
        let neighbour = start(&server, &id, "for i in $(seq 1 20); do echo tick$i; sleep 0.1; done");
        let hog = start(&server, &id, hog);
        let result = wait_result(&server, &id, &hog);
        assert_eq!(result["oom_killed"], true, "the {name} hog was killed for memory: {result}");
        // Killed itself, or its shell reported the kill (128 + 9).
        assert!(result["signal"] == "KILL" || result["exit_code"] == 137, "{result}");
        let finished = wait_result(&server, &id, &neighbour);
        assert_eq!(finished["exit_code"], 0, "the neighbour of the {name} hog finished: {finished}");
        assert_eq!(finished["oom_killed"], false);
        let frames = server.output(&id, &neighbour, "");
        assert!(common::text_of(&frames, "stdout").ends_with("tick20\n"), "every tick of the neighbour");
        assert_eq!(server.exec(&id, json!({"cmd": "echo alive"}))["stdout"], "alive\n");
        let sandbox = server.ok("GET", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(sandbox["state"], "running", "the sandbox lives on after the {name} hog: {sandbox}");
    }
    server.delete_sandbox(&id);
}

#[test]
fn tmp_is_disk_under_the_quota_and_shm_is_a_small_share_of_memory() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base", "memory_mib": 512, "disk_mib": 4096}));
    // 2 GiB into /tmp of a 512 MiB sandbox: disk, not memory.
    let fill = server.exec(
        &id,
        json!({"cmd": "dd if=/dev/zero of=/tmp/big bs=1M count=2048 2>&1 | tail -1; stat -c %s /tmp/big",
               "timeout_s": 300}),
    );
    assert_eq!(fill["result"]["exit_code"], 0, "{fill}");
    assert!(fill["stdout"].as_str().unwrap().ends_with(&format!("{}\n", 2048u64 << 20)), "{fill}");
    let host_view = data.data.sandbox_dir(&id).join("rootfs/tmp/big");
    assert_eq!(std::fs::metadata(&host_view).unwrap().len(), 2048 << 20, "the file is on the sandbox's disk");
    assert_eq!(server.exec(&id, json!({"cmd": "rm /tmp/big && echo alive"}))["stdout"], "alive\n");

    // Past the disk quota, /tmp fails with a quota error; the sandbox lives on.
    let small = server.create_sandbox(json!({"template": "base", "memory_mib": 512, "disk_mib": 1024}));
    let over = server.exec(
        &small,
        json!({"cmd": "dd if=/dev/zero of=/tmp/big bs=1M count=2048 2>&1; echo dd=$?", "timeout_s": 300}),
    );
    let out = over["stdout"].as_str().unwrap();
    assert!(out.contains("Disk quota exceeded") && out.contains("dd=1"), "{out}");
    assert_eq!(server.exec(&small, json!({"cmd": "rm /tmp/big; echo alive"}))["stdout"], "alive\n");
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{small}"), None)["state"], "running");

    // /dev/shm is memory, capped at a quarter of the sandbox's.
    let shm = server.exec(&id, json!({"cmd": "df -k --output=size /dev/shm | tail -1"}));
    let kib: u64 = shm["stdout"].as_str().unwrap().trim().parse().unwrap();
    assert!(kib <= 128 * 1024, "/dev/shm is {kib} KiB in a 512 MiB sandbox");
    let tmp = server.exec(&id, json!({"cmd": "df --output=fstype /tmp | tail -1"}));
    assert_ne!(tmp["stdout"].as_str().unwrap().trim(), "tmpfs", "/tmp is not memory: {tmp}");
    server.delete_sandbox(&id);
    server.delete_sandbox(&small);
}
