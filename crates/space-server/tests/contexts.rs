//! Code contexts on real runsc: an interpreter kept alive in the
//! `code-interpreter` template, runs streamed back as NDJSON.

mod common;

use std::io::Read;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::TestServer;
use serde_json::{json, Value};
use space_host::template::{BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE};
use space_testkit::TestDataDir;

fn data() -> TestDataDir {
    TestDataDir::with_templates(&[BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE])
}

/// Runs `code` and returns every event, the `end` last.
fn run(server: &TestServer, sandbox: &str, context: &str, body: Value) -> Vec<Value> {
    let path = format!("/v1/sandboxes/{sandbox}/contexts/{context}/run");
    let mut text = String::new();
    let mut answer = server.client().post_reader(&path, &body).unwrap_or_else(|e| panic!("POST {path}: {e}"));
    answer.read_to_string(&mut text).unwrap_or_else(|e| panic!("POST {path}: reading the run: {e}"));
    let events: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.last().map(|e| e["type"].clone()), Some(json!("end")), "{text}");
    events
}

fn code(server: &TestServer, sandbox: &str, context: &str, code: &str) -> Vec<Value> {
    run(server, sandbox, context, json!({"code": code}))
}

fn main_text(events: &[Value]) -> Option<String> {
    events
        .iter()
        .find(|e| e["type"] == "result" && e["is_main_result"] == true)
        .and_then(|e| e["data"]["text/plain"].as_str().map(str::to_string))
}

fn of_type<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["type"] == kind).collect()
}

/// How long a run may take to end after its interrupt (a driver replaces
/// an interpreter that ignores one for 5 s; this is far past that).
const INTERRUPT_PATIENCE: Duration = Duration::from_secs(30);

/// A run going on, its answer read on a thread of its own.
struct Running {
    events: std::sync::mpsc::Receiver<Result<Vec<Value>, String>>,
}

impl Running {
    /// Starts a run of `code` and returns once the server accepted it (its
    /// answer's head came).
    fn start(server: &TestServer, sandbox: &str, context: &str, code: &str) -> Running {
        // The client's deadline (two minutes) bounds the reading thread too.
        let mut response = server
            .client()
            .post_reader(&format!("/v1/sandboxes/{sandbox}/contexts/{context}/run"), &json!({"code": code}))
            .expect("the run is accepted");
        let (sender, events) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut text = String::new();
            let read = response
                .read_to_string(&mut text)
                .map_err(|e| e.to_string())
                .and_then(|_| text.lines().map(|l| serde_json::from_str(l).map_err(|e| format!("{e}: {l}"))).collect());
            let _ = sender.send(read);
        });
        Running { events }
    }

    /// Its events, the end last; fails if it does not end in time.
    fn end(self, what: &str) -> Vec<Value> {
        let events = self
            .events
            .recv_timeout(INTERRUPT_PATIENCE)
            .unwrap_or_else(|_| panic!("{what}: the run did not end within {INTERRUPT_PATIENCE:?}"))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(events.last().map(|e| e["type"].clone()), Some(json!("end")), "{what}: {events:?}");
        events
    }
}

fn interrupt(server: &TestServer, sandbox: &str, context: &str) {
    server.ok("POST", &format!("/v1/sandboxes/{sandbox}/contexts/{context}/interrupt"), None);
}

/// An interrupted run: it ended `interrupted` with a `KeyboardInterrupt`.
fn assert_interrupted(what: &str, events: &[Value]) {
    assert_eq!(events.last().unwrap()["status"], "interrupted", "{what}: {events:?}");
    assert!(of_type(events, "error").iter().any(|e| e["name"] == "KeyboardInterrupt"), "{what}: {events:?}");
}

/// A random number below `n`.
fn below(n: u64) -> u64 {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes).unwrap();
    u64::from_le_bytes(bytes) % n.max(1)
}

#[test]
fn a_python_context_keeps_state_and_returns_rich_results() {
    let data = data();
    let server = TestServer::start(&data);
    // Two kernels, one with pandas and matplotlib loaded: more than 512 MiB.
    let id = server.create_sandbox(json!({"template": CODE_INTERPRETER_TEMPLATE, "memory_mib": 1024}));
    let base = format!("/v1/sandboxes/{id}/contexts");
    let (status, context) = server.call("POST", &base, Some(json!({"language": "python", "env": {"WHO": "ctx"}})));
    assert_eq!(status, 201, "{context}");
    assert_eq!(context["state"], "ready");
    let cid = context["id"].as_str().unwrap().to_string();

    // State carries over; the last expression is the result.
    let first = code(&server, &id, &cid, "x = 41\nimport os\nprint('hello', os.environ['WHO'])");
    assert_eq!(of_type(&first, "stdout")[0]["text"], "hello ctx\n");
    assert_eq!(first.last().unwrap()["status"], "ok");
    let second = code(&server, &id, &cid, "x + 1");
    assert_eq!(main_text(&second).as_deref(), Some("42"));
    let count = |events: &[Value]| events.last().unwrap()["execution_count"].as_u64().unwrap();
    assert_eq!(count(&second), count(&first) + 1);
    let err = code(&server, &id, &cid, "import sys\nprint('to stderr', file=sys.stderr)");
    assert_eq!(of_type(&err, "stderr")[0]["text"], "to stderr\n");

    // A chart shown without savefig comes back as a PNG.
    let chart = code(&server, &id, &cid, "import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()");
    let png = of_type(&chart, "result")
        .iter()
        .find_map(|e| e["data"]["image/png"].as_str())
        .map(|b64| base64::engine::general_purpose::STANDARD.decode(b64.trim()).unwrap())
        .expect("an image/png result");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let (width, height) =
        (u32::from_be_bytes(png[16..20].try_into().unwrap()), u32::from_be_bytes(png[20..24].try_into().unwrap()));
    assert!(width > 200 && height > 200, "{width}x{height}");
    // A DataFrame as an HTML table.
    let frame = code(&server, &id, &cid, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})");
    let html = of_type(&frame, "result")[0]["data"]["text/html"].as_str().unwrap().to_string();
    assert!(html.contains("<table") && html.contains("<th>b</th>"), "{html}");

    // Markdown, SVG and JSON as their MIME types; what a program the cell
    // starts writes is output too.
    let shown = code(
        &server,
        &id,
        &cid,
        "from IPython.display import Markdown, SVG, JSON, display\nimport subprocess\n\
         display(Markdown('**bold**'))\n\
         display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"4\" height=\"4\"></svg>'))\n\
         subprocess.run(['echo', 'from a program'])\nJSON({'a': [1, 2]})",
    );
    let results = of_type(&shown, "result");
    assert_eq!(results.len(), 3, "{shown:?}");
    assert_eq!(results[0]["data"]["text/markdown"], "**bold**", "{shown:?}");
    assert!(results[1]["data"]["image/svg+xml"].as_str().unwrap().starts_with("<svg"), "{shown:?}");
    assert_eq!(results[2]["data"]["application/json"], json!({"a": [1, 2]}), "{shown:?}");
    assert_eq!(results[2]["is_main_result"], true);
    let printed: String = of_type(&shown, "stdout").iter().map(|e| e["text"].as_str().unwrap()).collect();
    assert_eq!(printed, "from a program\n", "{shown:?}");

    // An exception: its name, value and a plain traceback.
    let failed = code(&server, &id, &cid, "def f():\n    return 1 / 0\nf()");
    let error = of_type(&failed, "error")[0];
    assert_eq!(
        (error["name"].as_str(), error["value"].as_str()),
        (Some("ZeroDivisionError"), Some("division by zero"))
    );
    let traceback =
        error["traceback"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect::<Vec<_>>().join("\n");
    assert!(traceback.contains("return 1 / 0") && !traceback.contains('\u{1b}'), "{traceback}");
    assert_eq!(failed.last().unwrap()["status"], "error");

    // A run that never ends is stopped at its timeout; the context stays.
    let endless = run(&server, &id, &cid, json!({"code": "while True:\n    pass", "timeout_s": 2}));
    assert_eq!(endless.last().unwrap()["status"], "timeout", "{endless:?}");
    assert_eq!(main_text(&code(&server, &id, &cid, "x")).as_deref(), Some("41"));

    // One run at a time; an interrupt ends the one going on.
    let long = Running::start(&server, &id, &cid, "import time\ntime.sleep(60)");
    space_testkit::wait_until("the run to start", space_testkit::PATIENCE, || {
        server.ok("GET", &format!("{base}/{cid}"), None)["state"] == "busy"
    });
    server.error("POST", &format!("{base}/{cid}/run"), Some(json!({"code": "1"})), 409, "context_busy");
    // A checkpoint does not wait for the run (it is saved with it going on).
    let (status, saved) =
        server.call("POST", &format!("/v1/sandboxes/{id}/checkpoints"), Some(json!({"name": "mid-run"})));
    assert_eq!(status, 202, "{saved}");
    let saved = server.wait_operation(saved["operation"]["id"].as_str().unwrap());
    assert_eq!(saved["state"], "succeeded", "{saved}");
    assert_eq!(server.ok("GET", &format!("{base}/{cid}"), None)["state"], "busy");
    interrupt(&server, &id, &cid);
    assert_interrupted("a sleep", &long.end("a sleep"));
    assert_eq!(main_text(&code(&server, &id, &cid, "x")).as_deref(), Some("41"));

    // The same run as server-sent events.
    let auth = format!("Bearer {}", server.key);
    let (status, events) = server.raw(
        "POST",
        &format!("{base}/{cid}/run"),
        &[("Authorization", &auth), ("Content-Type", "application/json"), ("Accept", "text/event-stream")],
        Some(r#"{"code": "print('sse')\nx"}"#),
    );
    assert_eq!(status, 200);
    assert!(events.starts_with("event: stdout\ndata: {") && events.contains("event: end\ndata: "), "{events}");

    // Two contexts do not see each other's variables.
    let (_, other) = server.call("POST", &base, Some(json!({})));
    let other = other["id"].as_str().unwrap().to_string();
    let missing = code(&server, &id, &other, "x");
    assert_eq!(of_type(&missing, "error")[0]["name"], "NameError");
    let listed = server.ok("GET", &base, None);
    assert_eq!(listed["contexts"].as_array().unwrap().len(), 2, "{listed}");

    // Through a pause and a suspend, the interpreter keeps its state.
    for action in ["pause", "resume", "suspend", "resume"] {
        let (status, accepted) = server.call("POST", &format!("/v1/sandboxes/{id}/{action}"), None);
        assert_eq!(status, 202, "{accepted}");
        assert_eq!(server.wait_operation(accepted["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    }
    assert_eq!(main_text(&code(&server, &id, &cid, "x + 1")).as_deref(), Some("42"));

    // An interpreter that dies says so, and comes back after a restart.
    let died = code(&server, &id, &cid, "import os\nos._exit(3)");
    assert_eq!(died.last().unwrap()["status"], "died", "{died:?}");
    assert_eq!(server.ok("GET", &format!("{base}/{cid}"), None)["state"], "dead");
    server.error("POST", &format!("{base}/{cid}/run"), Some(json!({"code": "1"})), 409, "context_dead");
    let restarted = server.ok("POST", &format!("{base}/{cid}/restart"), None);
    assert_eq!(restarted["state"], "ready");
    assert_eq!(of_type(&code(&server, &id, &cid, "x"), "error")[0]["name"], "NameError");
    assert_eq!(main_text(&code(&server, &id, &cid, "2 ** 10")).as_deref(), Some("1024"));

    // Bad input.
    server.error("POST", &base, Some(json!({"language": "cobol"})), 422, "invalid_value");
    server.error("POST", &base, Some(json!({"colour": "red"})), 400, "invalid_request");
    server.error("GET", &format!("{base}/ctx_00000000000000000000"), None, 404, "not_found");
    assert_eq!(server.call("DELETE", &format!("{base}/{other}"), None).0, 204);
    server.error("GET", &format!("{base}/{other}"), None, 404, "not_found");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}

#[test]
fn a_javascript_context_keeps_state() {
    let data = data();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": CODE_INTERPRETER_TEMPLATE}));
    let base = format!("/v1/sandboxes/{id}/contexts");
    let (status, context) = server.call("POST", &base, Some(json!({"language": "javascript"})));
    assert_eq!(status, 201, "{context}");
    assert_eq!(context["language"], "javascript");
    let cid = context["id"].as_str().unwrap().to_string();
    let first = code(&server, &id, &cid, "let x = 40; const add = (a, b) => a + b; console.log('set', x)");
    assert_eq!(of_type(&first, "stdout")[0]["text"], "set 40\n");
    assert_eq!(main_text(&code(&server, &id, &cid, "add(x, 2)")).as_deref(), Some("42"));
    let object = code(&server, &id, &cid, "({a: [1, 2]})");
    assert_eq!(of_type(&object, "result")[0]["data"]["application/json"], json!({"a": [1, 2]}));
    let thrown = code(&server, &id, &cid, "throw new TypeError('nope')");
    let error = of_type(&thrown, "error")[0];
    assert_eq!((error["name"].as_str(), error["value"].as_str()), (Some("TypeError"), Some("nope")));
    let endless = run(&server, &id, &cid, json!({"code": "while (true) {}", "timeout_s": 1}));
    assert_eq!(endless.last().unwrap()["status"], "timeout");
    assert_eq!(main_text(&code(&server, &id, &cid, "x")).as_deref(), Some("40"), "the context stays");
    // Interrupted by a signal, since a run blocks the driver's thread.
    let long = Running::start(&server, &id, &cid, "for (;;) {}");
    space_testkit::wait_until("the run to start", space_testkit::PATIENCE, || {
        server.ok("GET", &format!("{base}/{cid}"), None)["state"] == "busy"
    });
    interrupt(&server, &id, &cid);
    assert_interrupted("an endless loop", &long.end("an endless loop"));
    assert_eq!(main_text(&code(&server, &id, &cid, "x")).as_deref(), Some("40"), "the context stays");
    // Its process exits: dead until restarted, then fresh.
    let died = code(&server, &id, &cid, "process.exit(1)");
    assert_eq!(died.last().unwrap()["status"], "died", "{died:?}");
    server.error("POST", &format!("{base}/{cid}/run"), Some(json!({"code": "1"})), 409, "context_dead");
    assert_eq!(server.ok("POST", &format!("{base}/{cid}/restart"), None)["state"], "ready");
    assert_eq!(of_type(&code(&server, &id, &cid, "x"), "error")[0]["name"], "ReferenceError");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}

#[test]
fn a_bash_context_keeps_its_shell() {
    let data = data();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": BASE_TEMPLATE}));
    let base = format!("/v1/sandboxes/{id}/contexts");
    // A relative cwd is refused, as for a command (it was taken as given).
    server.error("POST", &base, Some(json!({"language": "bash", "cwd": "tmp"})), 400, "invalid_request");
    let (status, context) = server.call("POST", &base, Some(json!({"language": "bash"})));
    assert_eq!(status, 201, "{context}");
    let cid = context["id"].as_str().unwrap().to_string();
    let first = code(&server, &id, &cid, "export GREETING=hi; cd /tmp; count() { echo $(( $1 + 1 )); }; echo set");
    assert_eq!(of_type(&first, "stdout")[0]["text"], "set\n");
    let second = code(&server, &id, &cid, "echo $GREETING $(pwd) $(count 41); echo oops >&2");
    let out: String = of_type(&second, "stdout").iter().map(|e| e["text"].as_str().unwrap()).collect();
    assert_eq!(out, "hi /tmp 42\n");
    let err: String = of_type(&second, "stderr").iter().map(|e| e["text"].as_str().unwrap()).collect();
    assert_eq!(err, "oops\n");
    let failed = code(&server, &id, &cid, "printf 'no newline'; false");
    assert_eq!(of_type(&failed, "stdout")[0]["text"], "no newline");
    assert_eq!(
        (failed.last().unwrap()["status"].as_str(), failed.last().unwrap()["exit_code"].as_i64()),
        (Some("error"), Some(1))
    );
    let slept = run(&server, &id, &cid, json!({"code": "sleep 60", "timeout_s": 1}));
    assert_eq!(slept.last().unwrap()["status"], "timeout", "{slept:?}");
    let after: String = of_type(&code(&server, &id, &cid, "echo $GREETING"), "stdout")
        .iter()
        .map(|e| e["text"].as_str().unwrap())
        .collect();
    assert_eq!(after, "hi\n", "the shell stays");
    // An interrupt unwinds the whole run (functions, the rest of the code)
    // as Ctrl-C does, and keeps the shell.
    let code_of = "unwound() { while :; do :; done; echo in-function; }\nunwound\necho after";
    let long = Running::start(&server, &id, &cid, code_of);
    space_testkit::wait_until("the run to start", space_testkit::PATIENCE, || {
        server.ok("GET", &format!("{base}/{cid}"), None)["state"] == "busy"
    });
    interrupt(&server, &id, &cid);
    let interrupted = long.end("a loop in a function");
    assert_interrupted("a loop in a function", &interrupted);
    assert!(of_type(&interrupted, "stdout").is_empty(), "nothing after the loop ran: {interrupted:?}");
    assert_eq!(interrupted.last().unwrap()["exit_code"], 130);
    let after: String = of_type(&code(&server, &id, &cid, "echo $GREETING"), "stdout")
        .iter()
        .map(|e| e["text"].as_str().unwrap())
        .collect();
    assert_eq!(after, "hi\n", "the shell stays");
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}

/// Interrupts sent at any moment after `run` (a third at once, a third
/// within 5 ms, the rest within 300 ms) to python, javascript and bash
/// contexts running endless loops side by side (the loops load the
/// machine): every run ends `interrupted`, each context stays usable with
/// its state, and no interpreter dies.
#[test]
fn interrupts_at_any_moment_are_never_lost() {
    const ROUNDS: usize = 70;
    let data = data();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": CODE_INTERPRETER_TEMPLATE}));
    let base = format!("/v1/sandboxes/{id}/contexts");
    let languages = [
        ("python", "n = 0", "while True:\n    n += 1", "print(n > 0)"),
        ("javascript", "var n = 0", "for (;;) { n++ }", "console.log(n > 0 ? 'True' : 'False')"),
        ("bash", "n=0", "while :; do n=$((n+1)); done", "(( n > 0 )) && echo True || echo False"),
    ];
    let contexts: Vec<String> = languages
        .iter()
        .map(|(language, setup, _, _)| {
            let (status, context) = server.call("POST", &base, Some(json!({"language": language})));
            assert_eq!(status, 201, "{context}");
            let cid = context["id"].as_str().unwrap().to_string();
            code(&server, &id, &cid, setup);
            cid
        })
        .collect();
    let slowest = std::thread::scope(|scope| {
        let workers: Vec<_> = languages
            .iter()
            .zip(&contexts)
            .map(|((language, _, endless, _), cid)| {
                let (server, id) = (&server, &id);
                scope.spawn(move || {
                    let mut slowest = Duration::ZERO;
                    for round in 0..ROUNDS {
                        let offset = match round % 3 {
                            0 => 0,
                            1 => below(5_000),
                            _ => below(300_000),
                        };
                        let running = Running::start(server, id, cid, endless);
                        std::thread::sleep(Duration::from_micros(offset));
                        let asked = Instant::now();
                        interrupt(server, id, cid);
                        let what = format!("{language}, round {round}, interrupted {offset} µs after run");
                        assert_interrupted(&what, &running.end(&what));
                        slowest = slowest.max(asked.elapsed());
                    }
                    (*language, slowest)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("a language's rounds")).collect::<Vec<_>>()
    });
    eprintln!("{ROUNDS} interrupts per language; slowest from interrupt to end: {slowest:?}");
    for ((language, _, _, check), cid) in languages.iter().zip(&contexts) {
        let events = code(&server, &id, cid, check);
        let printed: String = of_type(&events, "stdout").iter().map(|e| e["text"].as_str().unwrap()).collect();
        assert_eq!(printed, "True\n", "{language} keeps its state: {events:?}");
        let context = server.ok("GET", &format!("{base}/{cid}"), None);
        assert_eq!(context["state"], "ready", "{language}: {context}");
    }
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}

#[test]
fn a_template_without_a_kernel_says_so() {
    let data = data();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": BASE_TEMPLATE}));
    let refused = server.error("POST", &format!("/v1/sandboxes/{id}/contexts"), Some(json!({})), 422, "invalid_value");
    assert!(refused["error"]["message"].as_str().unwrap().contains("IPython"), "{refused}");
}

#[test]
fn contexts_survive_a_server_restart_and_go_on_in_forks() {
    let data = data();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": CODE_INTERPRETER_TEMPLATE}));
    let base = format!("/v1/sandboxes/{id}/contexts");
    let (status, python) = server.call("POST", &base, Some(json!({"language": "python"})));
    assert_eq!(status, 201, "{python}");
    let python = python["id"].as_str().unwrap().to_string();
    let (status, shell) = server.call("POST", &base, Some(json!({"language": "bash"})));
    assert_eq!(status, 201, "{shell}");
    let shell = shell["id"].as_str().unwrap().to_string();
    code(&server, &id, &python, "counter = 41");
    code(&server, &id, &shell, "kept=yes; cd /tmp");

    // A server killed and started again picks the same interpreters up.
    server.stop();
    let server = TestServer::start(&data);
    let listed = server.ok("GET", &base, None);
    let states: Vec<(&str, &str)> = listed["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["id"].as_str().unwrap(), c["state"].as_str().unwrap()))
        .collect();
    assert_eq!(states, vec![(python.as_str(), "ready"), (shell.as_str(), "ready")], "{listed}");
    assert_eq!(main_text(&code(&server, &id, &python, "counter += 1; counter")).as_deref(), Some("42"));
    let out = code(&server, &id, &shell, "echo \"$kept in $(pwd)\"");
    assert_eq!(of_type(&out, "stdout")[0]["text"], "yes in /tmp\n", "{out:?}");

    // A fork carries the interpreters on as contexts of its own.
    let (status, accepted) = server.call("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({})));
    assert_eq!(status, 202, "{accepted}");
    let fork = accepted["sandboxes"][0]["id"].as_str().unwrap().to_string();
    server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
    let copies = server.ok("GET", &format!("/v1/sandboxes/{fork}/contexts"), None);
    let copies: Vec<Value> = copies["contexts"].as_array().unwrap().clone();
    assert_eq!(copies.len(), 2, "{copies:?}");
    let copy = copies.iter().find(|c| c["language"] == "python").unwrap();
    let copy = copy["id"].as_str().unwrap();
    assert_ne!(copy, python, "a fork's context is its own");
    assert_eq!(main_text(&code(&server, &fork, copy, "counter += 100; counter")).as_deref(), Some("142"));
    assert_eq!(main_text(&code(&server, &id, &python, "counter")).as_deref(), Some("42"), "the source's is untouched");
    server.error(
        "POST",
        &format!("/v1/sandboxes/{id}/contexts/{copy}/run"),
        Some(json!({"code": "1"})),
        404,
        "not_found",
    );

    // A context deleted before a restart stays deleted.
    assert_eq!(server.delete_sandbox(&fork)["state"], "succeeded");
    assert_eq!(server.call("DELETE", &format!("{base}/{shell}"), None).0, 204);
    server.stop();
    let server = TestServer::start(&data);
    let left = server.ok("GET", &base, None);
    assert_eq!(
        left["contexts"].as_array().unwrap().len(),
        1,
        "{left} {}",
        server.ok("GET", &format!("/v1/sandboxes/{id}"), None)
    );
    assert_eq!(main_text(&code(&server, &id, &python, "counter")).as_deref(), Some("42"));
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}

/// The drivers at their seam, with no round trip between a run and its
/// interrupt: in a sandbox, `contexts/interrupt_harness.py` writes each
/// interrupt 0 to 3 ms behind its run request to copies of the drivers the
/// server runs (interrupts there were lost: one taken before the driver
/// read its run, one between the cell's start and its SIGINT handler, a
/// JavaScript SIGINT while Node set up its watch killed the interpreter).
#[test]
fn the_drivers_take_an_interrupt_right_behind_its_run() {
    const ROUNDS: usize = 70;
    let data = data();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": CODE_INTERPRETER_TEMPLATE}));
    let sources = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in [
        "../space-node/src/contexts/python_charts.py",
        "../space-node/src/contexts/python_driver.py",
        "../space-node/src/contexts/js_driver.js",
        "../space-node/src/contexts/bash_driver.py",
        "tests/contexts/interrupt_harness.py",
    ] {
        let name = file.rsplit('/').next().unwrap();
        let source = std::fs::read(sources.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        server.client().upload_bytes(&id, &format!("/root/drivers/{name}"), &source).unwrap();
    }
    // Ended inside the test client's 120 s answer deadline, so a stuck
    // harness shows as the command's timeout, not a dropped connection.
    let ran = server.exec(
        &id,
        json!({"argv": ["python3", "/root/drivers/interrupt_harness.py", ROUNDS.to_string()], "timeout_s": 110}),
    );
    assert_eq!(ran["result"]["exit_code"], 0, "{ran}");
    let results: Value = serde_json::from_str(ran["stdout"].as_str().unwrap().trim()).unwrap();
    for language in ["python", "javascript", "bash"] {
        let result = &results[language];
        assert_eq!(
            (result["interrupted"].as_u64(), result["lost"].as_array().map(Vec::len), result["alive"].as_bool()),
            (Some(ROUNDS as u64), Some(0), Some(true)),
            "{language}: {result}"
        );
        assert_eq!(result["state_kept"], true, "{language}: {result}");
    }
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}

/// Starts a context of `language` in sandbox `id` and returns its id.
fn context_of(server: &TestServer, id: &str, language: &str) -> String {
    let (status, context) =
        server.call("POST", &format!("/v1/sandboxes/{id}/contexts"), Some(json!({"language": language})));
    assert_eq!(status, 201, "{language}: {context}");
    context["id"].as_str().unwrap().to_string()
}

fn stdout_of(events: &[Value]) -> String {
    of_type(events, "stdout").iter().map(|e| e["text"].as_str().unwrap()).collect()
}

/// What code written for E2B's code interpreter expects of the drivers:
/// per-run env in bash, ES module imports and top-level `await` in
/// JavaScript, TypeScript cells, a DataFrame's columns and a chart's data
/// beside their pictures, and `Image.save` showing the image.
#[test]
fn the_drivers_run_what_code_interpreter_users_write() {
    let data = data();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": CODE_INTERPRETER_TEMPLATE}));

    // Bash: a run's env is exported for it alone, quotes and all; a name
    // bash cannot take is refused.
    let shell = context_of(&server, &id, "bash");
    let with = run(&server, &id, &shell, json!({"code": "echo \"$WHO\"", "env": {"WHO": "it's \"e2b\""}}));
    assert_eq!(stdout_of(&with), "it's \"e2b\"\n", "{with:?}");
    let without = code(&server, &id, &shell, "echo ${WHO:-unset}");
    assert_eq!(stdout_of(&without), "unset\n", "{without:?}");
    let path = format!("/v1/sandboxes/{id}/contexts/{shell}/run");
    server.error("POST", &path, Some(json!({"code": "true", "env": {"NOT-A-NAME": "x"}})), 422, "invalid_value");

    // JavaScript: `import` declarations and top-level `await`; what an
    // awaiting cell declares stays for the next.
    let js = context_of(&server, &id, "javascript");
    let imported = code(
        &server,
        &id,
        &js,
        "import { readFileSync } from 'fs'\nimport * as os from 'os'\nconsole.log(typeof readFileSync, typeof os.cpus)",
    );
    assert_eq!(stdout_of(&imported), "function function\n", "{imported:?}");
    let awaited = code(&server, &id, &js, "const later = await Promise.resolve(20);\nlater + 1");
    assert_eq!(main_text(&awaited).as_deref(), Some("21"), "{awaited:?}");
    assert_eq!(main_text(&code(&server, &id, &js, "later * 2")).as_deref(), Some("40"));
    let rejected = code(&server, &id, &js, "await Promise.reject(new TypeError('no'))");
    assert_eq!(of_type(&rejected, "error")[0]["name"], "TypeError", "{rejected:?}");
    assert_eq!(rejected.last().unwrap()["status"], "error");
    // A cell awaiting what never settles ends at its interrupt, or its
    // timeout, and the context goes on.
    let waiting = Running::start(&server, &id, &js, "await new Promise(() => {})");
    space_testkit::wait_until("the awaiting run to start", space_testkit::PATIENCE, || {
        server.ok("GET", &format!("/v1/sandboxes/{id}/contexts/{js}"), None)["state"] == "busy"
    });
    interrupt(&server, &id, &js);
    assert_interrupted("an awaiting cell", &waiting.end("an awaiting cell"));
    let timed = run(&server, &id, &js, json!({"code": "await new Promise(() => {})", "timeout_s": 1}));
    assert_eq!(timed.last().unwrap()["status"], "timeout", "{timed:?}");
    assert_eq!(main_text(&code(&server, &id, &js, "later")).as_deref(), Some("20"));

    // TypeScript: types erased, the rest as JavaScript.
    let ts = context_of(&server, &id, "typescript");
    let typed = code(&server, &id, &ts, "interface P { x: number }\nconst p: P = { x: 41 };\np.x + 1");
    assert_eq!(main_text(&typed).as_deref(), Some("42"), "{typed:?}");

    // Python: a DataFrame's columns, a chart's data and an image saved.
    let py = context_of(&server, &id, "python");
    let frame =
        code(&server, &id, &py, "import pandas as pd\npd.DataFrame({'a': [1, 2, 3], 'b': [0.5, float('nan'), 2]})");
    let result = of_type(&frame, "result")[0];
    assert_eq!(result["data"]["e2b/data"], json!({"a": [1, 2, 3], "b": [0.5, null, 2.0]}), "{frame:?}");
    let chart = code(
        &server,
        &id,
        &py,
        "import matplotlib.pyplot as plt\nplt.bar(['x', 'y'], [3, 4], label='n')\nplt.title('T')\nplt.ylabel('Count (n)')\nplt.show()",
    );
    let shown = of_type(&chart, "result")[0];
    assert!(shown["data"]["image/png"].is_string(), "{chart:?}");
    let drawn = &shown["data"]["e2b/chart"];
    assert_eq!(
        (&drawn["type"], &drawn["title"], &drawn["y_unit"]),
        (&json!("bar"), &json!("T"), &json!("n")),
        "{drawn}"
    );
    assert_eq!(
        drawn["elements"],
        json!([{"label": "x", "group": "n", "value": 3}, {"label": "y", "group": "n", "value": 4}])
    );
    let saved = code(
        &server,
        &id,
        &py,
        "from PIL import Image\nImage.new('RGB', (4, 4)).save('/tmp/x.png')\nImage.open('/tmp/x.png').size",
    );
    let results = of_type(&saved, "result");
    assert!(results.iter().any(|r| r["data"]["image/png"].is_string() && r["is_main_result"] == false), "{saved:?}");
    assert_eq!(main_text(&saved).as_deref(), Some("(4, 4)"));
    assert_eq!(server.delete_sandbox(&id)["state"], "succeeded");
}
