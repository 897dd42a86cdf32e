//! `GET /v1/events` on a real server with real sandboxes: live (SSE and
//! NDJSON), resumable, tenant-scoped, kept across a restart, and every
//! event matching the contract.

mod common;

use std::io::BufRead;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::{json, Value};
use space_server::tenants::create_key;
use space_testkit::TestDataDir;

/// Follows `/v1/events?{query}` as SSE in a thread: each event's `data`
/// on the channel.
fn follow_sse(server: &TestServer, key: &str, query: &str) -> mpsc::Receiver<Value> {
    let (tx, rx) = mpsc::channel();
    // The test kit's agent: each read has a deadline, not the whole stream,
    // which stays open for as long as the test follows it.
    let client = space_client::Client::with_agent(&server.url, key, space_testkit::http());
    let path = format!("/v1/events?follow=true&{query}");
    let answer = client.open("GET", &path, &[("Accept", "text/event-stream")]).expect("opening the event stream");
    assert_eq!((answer.status, answer.header("content-type")), (200, Some("text/event-stream")));
    std::thread::spawn(move || {
        let mut id = None;
        for line in std::io::BufReader::new(answer.body).lines() {
            let Ok(line) = line else { return };
            if let Some(rest) = line.strip_prefix("id: ") {
                id = rest.parse::<u64>().ok();
            } else if let Some(data) = line.strip_prefix("data: ") {
                let event: Value = serde_json::from_str(data).expect("an event's data is JSON");
                // The SSE id is the event's.
                assert_eq!(Some(event["id"].as_u64().unwrap()), id, "{event}");
                if tx.send(event).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

/// Receives events until `done` says so (or the deadline passes).
fn collect_until(rx: &mpsc::Receiver<Value>, done: impl Fn(&Value) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = rx.recv_timeout(left).unwrap_or_else(|_| panic!("the awaited event never came; saw {seen:#?}"));
        let stop = done(&event);
        seen.push(event);
        if stop {
            return seen;
        }
    }
}

/// NDJSON events (without follow), each checked against the contract.
fn read_events(server: &TestServer, key: &str, query: &str, headers: &[(&str, &str)]) -> Vec<Value> {
    let path = format!("/v1/events?{query}");
    let answer = server.client_as(key).call_bytes("GET", &path, headers, None).expect("reading events");
    let body = String::from_utf8(answer.body).unwrap();
    assert_eq!(answer.status, 200, "{body}");
    body.lines()
        .map(|line| {
            let event: Value = serde_json::from_str(line).unwrap();
            server.check("GET", &path, 200, "application/x-ndjson", &event);
            event
        })
        .collect()
}

fn summary(events: &[Value], sandbox: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["sandbox_id"] == sandbox)
        .map(|e| {
            let detail = match e["type"].as_str().unwrap() {
                "sandbox.state" => e["sandbox"]["state"].as_str().unwrap().to_string(),
                "operation.progress" | "operation.finished" => {
                    format!(
                        "{}:{}",
                        e["operation"]["kind"].as_str().unwrap(),
                        e["operation"]["state"].as_str().unwrap()
                    )
                }
                "command.started" => e["command"]["argv"].to_string(),
                "command.exited" => e["command"]["result"]["exit_code"].to_string(),
                other => panic!("unexpected event type {other}"),
            };
            format!("{} {detail}", e["type"].as_str().unwrap())
        })
        .collect()
}

#[test]
fn events_follow_each_change_live_resume_by_id_stay_with_their_tenant_and_survive_a_restart() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let (_, a) = create_key(server.platform.store(), "team-a", None).unwrap();
    let (_, b) = create_key(server.platform.store(), "team-b", None).unwrap();

    // Following before anything happens: only what comes from now on.
    let live = follow_sse(&server, &a, "");
    let (status, accepted) = server.call_as(&a, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["sandbox"]["id"].as_str().unwrap().to_string();
    let (status, other) = server.call_as(&b, "POST", "/v1/sandboxes", Some(json!({"template": "base"})));
    assert_eq!(status, 202, "{other}");
    let other_id = other["sandbox"]["id"].as_str().unwrap().to_string();
    let running = collect_until(&live, |e| e["sandbox_id"] == id.as_str() && e["sandbox"]["state"] == "running");
    let (status, ran) =
        server.call_as(&a, "POST", &format!("/v1/sandboxes/{id}/exec"), Some(json!({"cmd": "echo hi; exit 3"})));
    assert_eq!((status, ran["result"]["exit_code"].as_i64()), (200, Some(3)), "{ran}");
    for action in ["pause", "resume"] {
        let (status, body) = server.call_as(&a, "POST", &format!("/v1/sandboxes/{id}/{action}"), Some(json!({})));
        assert_eq!(status, 202, "{body}");
        let op = body["operation"]["id"].as_str().unwrap();
        server.call_as(&a, "GET", &format!("/v1/operations/{op}?wait=30"), None);
    }
    let (status, deleted) = server.call_as(&a, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 202, "{deleted}");
    let rest = collect_until(&live, |e| {
        e["sandbox_id"] == id.as_str() && e["type"] == "operation.finished" && e["operation"]["kind"] == "delete"
    });
    let seen: Vec<Value> = running.into_iter().chain(rest).collect();
    for event in &seen {
        server.check("GET", "/v1/events", 200, "application/x-ndjson", event);
        assert_ne!(event["sandbox_id"], other_id.as_str(), "another tenant's sandbox in A's stream: {event}");
    }
    let steps = summary(&seen, &id);
    let position =
        |step: &str| steps.iter().position(|s| s == step).unwrap_or_else(|| panic!("no {step} in {steps:#?}"));
    let order = [
        position("sandbox.state creating"),
        position("operation.finished create:succeeded"),
        position("command.started [\"/bin/sh\",\"-c\",\"echo hi; exit 3\"]"),
        position("command.exited 3"),
        position("sandbox.state paused"),
        position("operation.finished pause:succeeded"),
        position("operation.finished resume:succeeded"),
        position("sandbox.state deleted"),
        position("operation.finished delete:succeeded"),
    ];
    assert!(order.is_sorted(), "events out of order: {steps:#?}");
    assert!(position("sandbox.state running") < position("command.started [\"/bin/sh\",\"-c\",\"echo hi; exit 3\"]"));
    let ids: Vec<u64> = seen.iter().map(|e| e["id"].as_u64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids must grow: {ids:?}");

    // Resuming after an id gives exactly what followed it, for A only.
    let third = ids[2].to_string();
    let resumed = read_events(&server, &a, "", &[("Last-Event-ID", &third)]);
    let resumed_ids: Vec<u64> = resumed.iter().map(|e| e["id"].as_u64().unwrap()).collect();
    assert_eq!(resumed_ids, ids[3..].to_vec());
    let from = read_events(&server, &a, &format!("from={}&types=command", ids[0]), &[]);
    assert_eq!(summary(&from, &id), ["command.started [\"/bin/sh\",\"-c\",\"echo hi; exit 3\"]", "command.exited 3"]);
    let newest = read_events(&server, &a, &format!("limit=2&sandbox_id={id}"), &[]);
    assert_eq!(newest.iter().map(|e| e["id"].as_u64().unwrap()).collect::<Vec<_>>(), ids[ids.len() - 2..].to_vec());
    // B sees its own sandbox and nothing of A's.
    let b_events = read_events(&server, &b, "from=0", &[]);
    assert!(b_events.iter().any(|e| e["sandbox_id"] == other_id.as_str()));
    assert!(b_events.iter().all(|e| e["sandbox_id"] != id.as_str()), "A's events reached B");

    // Bad requests are clear errors.
    for (query, header) in [
        ("types=sandboxes", None),
        ("limit=0", None),
        ("follow=true&limit=5", None),
        ("from=-1", None),
        ("", Some("not-a-number")),
    ] {
        let headers: Vec<(&str, &str)> = header.map(|value| ("Last-Event-ID", value)).into_iter().collect();
        let answer = server.client_as(&a).call_bytes("GET", &format!("/v1/events?{query}"), &headers, None).unwrap();
        let body = String::from_utf8_lossy(&answer.body);
        assert_eq!(answer.status, 400, "{query} {header:?}: {body}");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    }
    // By hand: a request with no key at all, which a client never sends.
    assert_eq!(server.raw("GET", "/v1/events", &[], None).0, 401);

    // A restarted server still has them, and goes on numbering after them.
    server.stop();
    let server = TestServer::start(&data);
    let kept: Vec<u64> = read_events(&server, &a, "from=0", &[]).iter().map(|e| e["id"].as_u64().unwrap()).collect();
    assert!(ids.iter().all(|id| kept.contains(id)), "kept {kept:?}, saw {ids:?}");
    let after = read_events(&server, &b, &format!("from={}", ids[ids.len() - 1]), &[]);
    let (status, gone) = server.call_as(&b, "DELETE", &format!("/v1/sandboxes/{other_id}"), None);
    assert_eq!(status, 202, "{gone}");
    let op = gone["operation"]["id"].as_str().unwrap();
    server.call_as(&b, "GET", &format!("/v1/operations/{op}?wait=30"), None);
    let later = read_events(&server, &b, &format!("from={}&types=operation.finished", ids[ids.len() - 1]), &[]);
    assert!(later.len() > after.iter().filter(|e| e["type"] == "operation.finished").count(), "{later:#?}");
    assert!(later.iter().all(|e| e["id"].as_u64().unwrap() > ids[ids.len() - 1]));
}
