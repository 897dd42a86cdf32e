//! A small blocking client of the SPACE API.

use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use space_api::{OutputFrame, ProcessResult};

pub struct Client {
    base: String,
    auth: String,
    agent: ureq::Agent,
}

impl Client {
    pub fn new(base: &str, key: &str) -> Client {
        let agent = ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(5)).build();
        Client { base: base.trim_end_matches('/').to_string(), auth: format!("Bearer {key}"), agent }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn key(&self) -> &str {
        self.auth.trim_start_matches("Bearer ")
    }

    fn request(&self, method: &str, path: &str) -> ureq::Request {
        self.agent.request(method, &format!("{}{path}", self.base)).set("Authorization", &self.auth)
    }

    fn answer(result: Result<ureq::Response, ureq::Error>) -> Result<serde_json::Value> {
        match result {
            Ok(response) => Ok(response.into_json().context("reading the answer")?),
            Err(ureq::Error::Status(status, response)) => {
                let body: serde_json::Value = response.into_json().unwrap_or_default();
                let error = &body["error"];
                bail!(
                    "HTTP {status} {}: {}",
                    error["code"].as_str().unwrap_or("error"),
                    error["message"].as_str().unwrap_or("no message")
                )
            }
            Err(err) => Err(err).context("reaching the SPACE server (is `space serve` running?)"),
        }
    }

    pub fn get(&self, path: &str) -> Result<serde_json::Value> {
        Self::answer(self.request("GET", path).call())
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
        Self::answer(self.request("POST", path).send_json(body))
    }

    pub fn put(&self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
        Self::answer(self.request("PUT", path).send_json(body))
    }

    /// A POST whose body is streamed from `body`.
    pub fn post_stream(&self, path: &str, content_type: &str, body: impl std::io::Read) -> Result<serde_json::Value> {
        Self::answer(self.request("POST", path).set("Content-Type", content_type).send(body))
    }

    /// A JSON POST whose answer is read as it streams (NDJSON).
    pub fn post_reader(&self, path: &str, body: &serde_json::Value) -> Result<Box<dyn std::io::Read + Send>> {
        match self.request("POST", path).send_json(body) {
            Ok(response) => Ok(Box::new(response.into_reader())),
            Err(err) => Self::answer(Err(err)).map(|_| Box::new(std::io::empty()) as Box<dyn std::io::Read + Send>),
        }
    }

    /// A DELETE answered with no body (204).
    pub fn delete_empty(&self, path: &str) -> Result<()> {
        match self.request("DELETE", path).call() {
            Ok(_) => Ok(()),
            Err(err) => Self::answer(Err(err)).map(drop),
        }
    }

    /// Any request with an optional text body; the status and the body as
    /// text, whatever the status (a server's own answer, not the API's).
    pub fn exchange(&self, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
        let request = self.request(method, path);
        let result = match body {
            Some(body) => request.send_string(body),
            None => request.call(),
        };
        let response = match result {
            Ok(response) | Err(ureq::Error::Status(_, response)) => response,
            Err(err) => return Err(err.into()),
        };
        Ok((response.status(), response.into_string()?))
    }

    /// A POST of raw bytes with extra headers; the status and the whole
    /// body, whatever the status (for routes that are not SPACE's own API,
    /// such as the E2B-compatible ones).
    pub fn post_bytes(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<(u16, Vec<u8>)> {
        let mut request = self.request("POST", path);
        for (name, value) in headers {
            request = request.set(name, value);
        }
        let response = match request.send_bytes(body) {
            Ok(response) | Err(ureq::Error::Status(_, response)) => response,
            Err(err) => return Err(err.into()),
        };
        let status = response.status();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut response.into_reader(), &mut bytes)?;
        Ok((status, bytes))
    }

    /// A GET of a text body.
    pub fn get_text(&self, path: &str) -> Result<String> {
        match self.request("GET", path).call() {
            Ok(response) => Ok(response.into_string()?),
            Err(err) => Self::answer(Err(err)).map(|_| String::new()),
        }
    }

    pub fn delete(&self, path: &str) -> Result<serde_json::Value> {
        Self::answer(self.request("DELETE", path).call())
    }

    /// Streams a local file into a sandbox.
    pub fn upload(&self, sandbox: &str, path: &str, mode: &str, file: std::fs::File) -> Result<()> {
        let target = format!("/v1/sandboxes/{sandbox}/files?path={}&mode={mode}", encode(path));
        Self::answer(self.request("PUT", &target).send(file)).map(drop)
    }

    /// Writes `bytes` to `path` in a sandbox.
    pub fn upload_bytes(&self, sandbox: &str, path: &str, bytes: &[u8]) -> Result<()> {
        let target = format!("/v1/sandboxes/{sandbox}/files?path={}", encode(path));
        Self::answer(self.request("PUT", &target).send_bytes(bytes)).map(drop)
    }

    /// Sends a tar archive to unpack into directory `path` of a sandbox.
    pub fn upload_tar(&self, sandbox: &str, path: &str, archive: Vec<u8>) -> Result<()> {
        let target = format!("/v1/sandboxes/{sandbox}/files?path={}&format=tar", encode(path));
        Self::answer(self.request("PUT", &target).send_bytes(&archive)).map(drop)
    }

    /// A directory of a sandbox as a tar archive.
    pub fn download_tar(&self, sandbox: &str, path: &str) -> Result<Vec<u8>> {
        let target = format!("/v1/sandboxes/{sandbox}/files?path={}&format=tar", encode(path));
        match self.request("GET", &target).call() {
            Ok(response) => {
                let mut archive = Vec::new();
                std::io::Read::read_to_end(&mut response.into_reader(), &mut archive)
                    .context("receiving the archive")?;
                Ok(archive)
            }
            Err(err) => Self::answer(Err(err)).map(|_| Vec::new()),
        }
    }

    /// Whether `path` in a sandbox is a directory.
    pub fn is_dir(&self, sandbox: &str, path: &str) -> Result<bool> {
        let target = format!("/v1/sandboxes/{sandbox}/files?path={}", encode(path));
        match self.request("GET", &target).call() {
            Ok(response) => Ok(response.content_type() == "application/json"),
            Err(err) => Self::answer(Err(err)).map(|_| false),
        }
    }

    /// Streams a file out of a sandbox into `out`.
    pub fn download(&self, sandbox: &str, path: &str, out: &mut impl Write) -> Result<()> {
        let target = format!("/v1/sandboxes/{sandbox}/files?path={}", encode(path));
        match self.request("GET", &target).call() {
            Ok(response) if response.content_type() == "application/json" => {
                bail!("{path} is a directory (directories are not supported yet)")
            }
            Ok(response) => {
                std::io::copy(&mut response.into_reader(), out).context("receiving the file")?;
                Ok(())
            }
            Err(err) => Self::answer(Err(err)).map(drop),
        }
    }

    /// Long-polls an operation until it is terminal.
    pub fn wait_operation(&self, id: &str) -> Result<serde_json::Value> {
        loop {
            let operation = self.get(&format!("/v1/operations/{id}?wait=30"))?;
            if matches!(operation["state"].as_str(), Some("succeeded" | "failed" | "cancelled")) {
                return Ok(operation);
            }
        }
    }

    /// Reads events (`GET /v1/events?{query}`) and hands each to `each`;
    /// with `follow`, keeps going, resuming after the last event seen when
    /// the stream breaks (the server restarting, say).
    pub fn events(
        &self,
        query: &str,
        from: Option<u64>,
        follow: bool,
        mut each: impl FnMut(space_api::Event) -> Result<()>,
    ) -> Result<()> {
        let mut last: Option<u64> = None;
        let mut failures = 0;
        loop {
            let mut path = format!("/v1/events?{query}");
            if follow {
                path.push_str("&follow=true");
            }
            if let Some(from) = from.filter(|_| last.is_none()) {
                path.push_str(&format!("&from={from}"));
            }
            let mut request = self.request("GET", &path);
            if let Some(last) = last {
                request = request.set("Last-Event-ID", &last.to_string());
            }
            let response = match request.call() {
                Ok(response) => response,
                Err(err) if !follow || failures >= 30 || matches!(err, ureq::Error::Status(..)) => {
                    return Self::answer(Err(err)).map(|_| ());
                }
                Err(_) => {
                    failures += 1;
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            };
            failures = 0;
            for line in BufReader::new(response.into_reader()).lines() {
                let Ok(line) = line else { break };
                if line.trim().is_empty() {
                    continue;
                }
                let event: space_api::Event = serde_json::from_str(&line).context("an event")?;
                last = Some(event.id);
                each(event)?;
            }
            if !follow {
                return Ok(());
            }
        }
    }

    /// Follows a command's output to its exit frame, counting the bytes.
    pub fn count_output(&self, output_path: &str) -> Result<u64> {
        let response = self.request("GET", &format!("{output_path}?follow=true")).call()?;
        let mut total = 0u64;
        for line in BufReader::with_capacity(1 << 20, response.into_reader()).lines() {
            match serde_json::from_str::<OutputFrame>(&line?)? {
                OutputFrame::Stdout { data, data_b64, .. } | OutputFrame::Stderr { data, data_b64, .. } => {
                    total += frame_bytes(data, data_b64)?.len() as u64;
                }
                OutputFrame::Exit { .. } => return Ok(total),
            }
        }
        bail!("the output stream ended without an exit frame")
    }

    /// Streams a command's output to our stdout/stderr until its exit frame,
    /// re-attaching from the last offset if the stream breaks.
    pub fn stream_output(&self, output_path: &str) -> Result<ProcessResult> {
        let mut offset = 0u64;
        let mut attempts = 0;
        loop {
            let response = self.request("GET", &format!("{output_path}?from={offset}&follow=true")).call();
            let response = match response {
                Ok(response) => response,
                Err(ureq::Error::Status(..)) => return Self::answer(response).and_then(|_| bail!("no output stream")),
                Err(err) if attempts < 5 => {
                    attempts += 1;
                    eprintln!("space: output stream failed ({err}); re-attaching at offset {offset}");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
                Err(err) => return Err(err).context("reading the output stream"),
            };
            let reader = BufReader::new(response.into_reader());
            for line in reader.lines() {
                let Ok(line) = line else { break };
                let frame: OutputFrame = serde_json::from_str(&line).context("an output frame")?;
                match frame {
                    OutputFrame::Stdout { offset: at, data, data_b64 } => {
                        let bytes = frame_bytes(data, data_b64)?;
                        offset = at + bytes.len() as u64;
                        let mut out = std::io::stdout().lock();
                        out.write_all(&bytes)?;
                        out.flush()?;
                    }
                    OutputFrame::Stderr { offset: at, data, data_b64 } => {
                        let bytes = frame_bytes(data, data_b64)?;
                        offset = at + bytes.len() as u64;
                        std::io::stderr().write_all(&bytes)?;
                    }
                    OutputFrame::Exit { result } => return Ok(result),
                }
            }
            attempts += 1;
            if attempts > 5 {
                bail!("the output stream kept breaking before the exit frame");
            }
            eprintln!("space: output stream ended early; re-attaching at offset {offset}");
        }
    }
}

/// Percent-encodes a path for a query string.
pub fn encode(path: &str) -> String {
    path.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}

fn frame_bytes(data: Option<String>, data_b64: Option<String>) -> Result<Vec<u8>> {
    match (data, data_b64) {
        (Some(text), _) => Ok(text.into_bytes()),
        (None, Some(b64)) => Ok(base64::engine::general_purpose::STANDARD.decode(b64)?),
        (None, None) => Ok(Vec::new()),
    }
}
