//! Shared by the engine tests: running a command through an agent.

use std::time::Duration;

use space_engine::{AgentConn, ExecEvent};
use space_proto::ExecRequest;

pub fn request(argv: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: Default::default(),
        cwd: None,
        user: None,
        stdin: false,
        tty: false,
    }
}

/// Runs `argv` to its end: its stdout, stderr and how it ended.
pub async fn run(agent: &AgentConn, argv: &[&str]) -> (Vec<u8>, Vec<u8>, space_proto::Exited) {
    let mut stream = agent.exec(&request(argv)).await.expect("exec");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        match tokio::time::timeout(Duration::from_secs(60), stream.next()).await.expect("exec timed out") {
            Some(ExecEvent::Stdout(b)) => out.extend(b),
            Some(ExecEvent::Stderr(b)) => err.extend(b),
            Some(ExecEvent::Exit(exited)) => return (out, err, exited),
            None => panic!("stream ended without an exit frame"),
        }
    }
}

/// A shell line's stdout, as text, after checking it exited 0.
pub async fn sh(agent: &AgentConn, line: &str) -> String {
    let (out, err, exited) = run(agent, &["sh", "-c", line]).await;
    assert_eq!(exited.exit_code, Some(0), "{line}: {}", String::from_utf8_lossy(&err));
    String::from_utf8_lossy(&out).into_owned()
}
