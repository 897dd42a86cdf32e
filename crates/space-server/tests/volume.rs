//! Volume and concurrency of command output, in a process of its own so the
//! memory figure is this test's alone.

mod common;

use std::io::{BufRead, BufReader};
use std::time::Instant;

use common::TestServer;
use serde_json::json;
use space_testkit::TestDataDir;

fn peak_rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 =
        status.lines().find(|l| l.starts_with("VmHWM:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kib / 1024
}

#[test]
fn concurrent_commands_and_a_large_output_arrive_whole_in_bounded_memory() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));

    // 20 concurrent `seq 1 20000`: each output exact, nothing mixed.
    let expected: String = (1..=20000).map(|i| format!("{i}\n")).collect();
    std::thread::scope(|scope| {
        let runs: Vec<_> =
            (0..20).map(|_| scope.spawn(|| server.exec(&id, json!({"argv": ["seq", "1", "20000"]})))).collect();
        for run in runs {
            let out = run.join().unwrap();
            assert_eq!(out["result"]["exit_code"], 0);
            assert!(out["stdout"].as_str().unwrap() == expected, "a seq output was cut, mixed or reordered");
        }
    });

    // 200 MiB streamed through the output endpoint while it is produced.
    const SIZE: u64 = 200 << 20;
    let created = server.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/commands"),
        Some(json!({"cmd": format!("head -c {SIZE} /dev/zero | tr '\\0' x")})),
    );
    let cid = created["command"]["id"].as_str().unwrap();
    let started = Instant::now();
    // The test kit's agent: each read has a deadline, not the whole stream.
    let client = space_client::Client::with_agent(&server.url, &server.key, space_testkit::http());
    let path = format!("/v1/sandboxes/{id}/commands/{cid}/output?follow=true");
    let answer = client.open("GET", &path, &[]).unwrap();
    assert_eq!(answer.status, 200);
    let (mut received, mut next_offset, mut exit) = (0u64, 0u64, None);
    for line in BufReader::with_capacity(1 << 20, answer.body).lines() {
        let frame: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        match frame["type"].as_str().unwrap() {
            "stdout" => {
                let data = frame["data"].as_str().unwrap();
                assert_eq!(frame["offset"].as_u64().unwrap(), next_offset, "frames are in order, without gaps");
                assert!(data.bytes().all(|b| b == b'x'));
                received += data.len() as u64;
                next_offset += data.len() as u64;
            }
            "exit" => exit = Some(frame["result"].clone()),
            other => panic!("unexpected frame {other}"),
        }
    }
    let elapsed = started.elapsed();
    let result = exit.expect("the stream ends with the exit frame");
    assert_eq!(result["exit_code"], 0);
    assert_eq!(received, SIZE, "all of the output arrived");
    assert_eq!(result["stdout_bytes"], SIZE);
    let peak = peak_rss_mib();
    eprintln!(
        "200 MiB streamed in {elapsed:?} ({:.0} MiB/s); peak RSS of server + client: {peak} MiB",
        SIZE as f64 / (1 << 20) as f64 / elapsed.as_secs_f64()
    );
    assert!(peak < 400, "the server's memory stays bounded: peak RSS {peak} MiB");
}
