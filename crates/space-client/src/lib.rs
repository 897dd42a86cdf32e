//! A blocking client of the SPACE API, over `space-api`'s wire types.
//!
//! Typed calls (`create_sandbox`, `exec`, `wait_for_operation`, …) return
//! the API's own types; the untyped ones (`get`, `post`, …) return the
//! answer as JSON, for callers that show it as the server sent it (the
//! CLI prints answers verbatim, fields a newer server added included).
//! Every error answer becomes [`ClientError::Api`], with its
//! [`ErrorCode`] when the code is one this client knows.

use std::io::{BufRead, BufReader, Read, Write};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use space_api::{
    CommandRequest, CreateSandboxRequest, ErrorCode, ExecResponse, Operation, OperationState, OutputFrame,
    ProcessResult, Sandbox, SandboxOperation,
};

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error.
    #[error("HTTP {status} {}: {message}", code.map_or("error", ErrorCode::as_str))]
    Api {
        status: u16,
        /// None for a code this client does not know (a newer server's):
        /// go by `status` then.
        code: Option<ErrorCode>,
        message: String,
        details: Value,
    },
    /// No answer: the server is not there, or the connection broke.
    #[error("reaching the SPACE server at {base} (is `space serve` running?): {source}")]
    Unreachable {
        base: String,
        #[source]
        source: Box<ureq::Error>,
    },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Decode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// An answer that breaks the API's contract.
    #[error("{0}")]
    Protocol(String),
}

impl ClientError {
    /// The error's code, when the server answered with one this client knows.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { code, .. } => *code,
            _ => None,
        }
    }

    /// The answer's status, when there was an answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// An error answer, `body` as the server sent it, as a failed call
    /// returns it.
    pub fn from_answer(status: u16, body: &Value) -> ClientError {
        let error = &body["error"];
        ClientError::Api {
            status,
            code: serde_json::from_value(error["code"].clone()).ok(),
            message: error["message"].as_str().unwrap_or("no message").to_string(),
            details: error["details"].clone(),
        }
    }

    fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> ClientError {
        move |source| ClientError::Io { what, source }
    }

    fn decode(what: &'static str) -> impl FnOnce(serde_json::Error) -> ClientError {
        move |source| ClientError::Decode { what, source }
    }
}

/// An answer of any status, as [`Client::call_with`] and
/// [`Client::send_with`] read it (its body as JSON), or
/// [`Client::call_bytes`] (its body as sent).
#[derive(Debug)]
pub struct Answer<B = Value> {
    pub status: u16,
    /// Names lower-cased, as ureq reads them.
    headers: Vec<(String, String)>,
    /// As JSON, null when the answer had no body (a 204).
    pub body: B,
}

impl<B> Answer<B> {
    /// A header's value, by its name in any case.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, value)| value.as_str())
    }
}

/// A client of one server with one API key.
pub struct Client {
    base: String,
    auth: String,
    agent: ureq::Agent,
}

impl Client {
    /// A client of the server at `base` (`http://127.0.0.1:7070`) with API
    /// key `key`. Connecting has a deadline of 5 s; answers are waited for
    /// as long as the server takes (long polls and streams).
    pub fn new(base: &str, key: &str) -> Client {
        Client::with_agent(base, key, ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(5)).build())
    }

    /// Like [`Client::new`], but every call must be over, its answer read
    /// to the end, within `deadline` (a test's: a server that stops
    /// answering fails the call instead of hanging it). Not for long polls
    /// or followed streams longer than that.
    pub fn with_deadline(base: &str, key: &str, deadline: Duration) -> Client {
        Client::with_agent(base, key, ureq::AgentBuilder::new().timeout(deadline).build())
    }

    /// Like [`Client::new`], over an agent of the caller's.
    pub fn with_agent(base: &str, key: &str, agent: ureq::Agent) -> Client {
        Client { base: base.trim_end_matches('/').to_string(), auth: format!("Bearer {key}"), agent }
    }

    /// A client of the same server with another key (a tenant's), over the
    /// same agent: its deadlines, and its connections, are this one's.
    pub fn with_key(&self, key: &str) -> Client {
        Client { base: self.base.clone(), auth: format!("Bearer {key}"), agent: self.agent.clone() }
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

    /// The response of a 2xx answer; any other becomes its error.
    fn accept(&self, result: Result<ureq::Response, ureq::Error>) -> Result<ureq::Response> {
        result.map_err(|err| self.error_of(err))
    }

    /// A failed call as the caller sees it: the server's error answer, or
    /// no answer at all.
    fn error_of(&self, err: ureq::Error) -> ClientError {
        match err {
            ureq::Error::Status(status, response) => {
                ClientError::from_answer(status, &response.into_json().unwrap_or_default())
            }
            err => ClientError::Unreachable { base: self.base.clone(), source: Box::new(err) },
        }
    }

    fn answer<T: DeserializeOwned>(&self, result: Result<ureq::Response, ureq::Error>) -> Result<T> {
        let response = self.accept(result)?;
        let text = response.into_string().map_err(ClientError::io("reading the answer"))?;
        serde_json::from_str(&text).map_err(ClientError::decode("reading the answer"))
    }

    // Typed calls.

    /// `POST /v1/sandboxes`: the sandbox being created and its operation.
    pub fn create_sandbox(&self, request: &CreateSandboxRequest) -> Result<SandboxOperation> {
        self.post_as("/v1/sandboxes", request)
    }

    /// `GET /v1/sandboxes/{id}`.
    pub fn sandbox(&self, id: &str) -> Result<Sandbox> {
        self.get_as(&format!("/v1/sandboxes/{id}"))
    }

    /// `DELETE /v1/sandboxes/{id}`: the delete's operation.
    pub fn delete_sandbox(&self, id: &str) -> Result<SandboxOperation> {
        self.answer(self.request("DELETE", &format!("/v1/sandboxes/{id}")).call())
    }

    /// `POST /v1/sandboxes/{id}/exec`: runs a command to its end.
    pub fn exec(&self, sandbox: &str, request: &CommandRequest) -> Result<ExecResponse> {
        self.post_as(&format!("/v1/sandboxes/{sandbox}/exec"), request)
    }

    /// `GET /v1/operations/{id}`.
    pub fn operation(&self, id: &str) -> Result<Operation> {
        self.get_as(&format!("/v1/operations/{id}"))
    }

    /// Long-polls an operation until it has ended; it, as it ended.
    pub fn wait_for_operation(&self, id: &str) -> Result<Operation> {
        loop {
            let operation: Operation = self.get_as(&format!("/v1/operations/{id}?wait=30"))?;
            if matches!(operation.state, OperationState::Succeeded | OperationState::Failed | OperationState::Cancelled)
            {
                return Ok(operation);
            }
        }
    }

    /// Long-polls an operation until it has ended or `patience` has passed;
    /// it, as last seen (not ended when the patience ran out: the caller
    /// decides what that means).
    pub fn wait_for_operation_within(&self, id: &str, patience: Duration) -> Result<Operation> {
        let deadline = Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(Instant::now()).as_secs().min(30);
            let operation: Operation = self.get_as(&format!("/v1/operations/{id}?wait={left}"))?;
            if operation.state.is_terminal() || Instant::now() >= deadline {
                return Ok(operation);
            }
        }
    }

    /// A GET whose answer is read as `T`.
    pub fn get_as<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.answer(self.request("GET", path).call())
    }

    /// A JSON POST whose answer is read as `T`.
    pub fn post_as<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Result<T> {
        self.answer(self.request("POST", path).send_json(body))
    }

    // Untyped calls: the answer as the server sent it.

    pub fn get(&self, path: &str) -> Result<Value> {
        self.get_as(path)
    }

    pub fn post(&self, path: &str, body: &Value) -> Result<Value> {
        self.post_as(path, body)
    }

    pub fn put(&self, path: &str, body: &Value) -> Result<Value> {
        self.answer(self.request("PUT", path).send_json(body))
    }

    pub fn delete(&self, path: &str) -> Result<Value> {
        self.answer(self.request("DELETE", path).call())
    }

    /// A POST whose body is streamed from `body`.
    pub fn post_stream(&self, path: &str, content_type: &str, body: impl std::io::Read) -> Result<Value> {
        self.answer(self.request("POST", path).set("Content-Type", content_type).send(body))
    }

    /// A JSON POST whose answer is read as it streams (NDJSON).
    pub fn post_reader(&self, path: &str, body: &Value) -> Result<Box<dyn std::io::Read + Send>> {
        Ok(Box::new(self.accept(self.request("POST", path).send_json(body))?.into_reader()))
    }

    /// A DELETE answered with no body (204).
    pub fn delete_empty(&self, path: &str) -> Result<()> {
        self.accept(self.request("DELETE", path).call()).map(drop)
    }

    /// Any request with an optional text body; the status and the body as
    /// text, whatever the status (a server's own answer, not the API's).
    pub fn exchange(&self, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
        let request = self.request(method, path);
        let result = match body {
            Some(body) => request.send_string(body),
            None => request.call(),
        };
        let response = self.any_status(result)?;
        Ok((response.status(), response.into_string().map_err(ClientError::io("reading the answer"))?))
    }

    /// Any request with an optional JSON body; the status and the answer as
    /// JSON, whatever the status (for tests of error answers).
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Value)> {
        self.call_with(method, path, &[], body).map(|answer| (answer.status, answer.body))
    }

    /// [`Client::call`] with extra headers (an `Idempotency-Key`, say); the
    /// whole answer, its headers too, whatever the status.
    pub fn call_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&Value>,
    ) -> Result<Answer> {
        let request = self.request_with(method, path, headers);
        let result = match body {
            Some(body) => request.send_json(body),
            None => request.call(),
        };
        self.whole_answer(result)
    }

    /// Any request whose body is streamed from `body` (a file; its
    /// `Content-Type` among `headers`); the whole answer, whatever the
    /// status.
    pub fn send_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl std::io::Read,
    ) -> Result<Answer> {
        self.whole_answer(self.request_with(method, path, headers).send(body))
    }

    fn request_with(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> ureq::Request {
        headers.iter().fold(self.request(method, path), |request, (name, value)| request.set(name, value))
    }

    fn whole_answer(&self, result: Result<ureq::Response, ureq::Error>) -> Result<Answer> {
        let Answer { status, headers, body } = self.bytes_answer(result)?;
        let body = match body.is_empty() {
            true => Value::Null,
            false => serde_json::from_slice(&body).map_err(ClientError::decode("reading the answer"))?,
        };
        Ok(Answer { status, headers, body })
    }

    fn bytes_answer(&self, result: Result<ureq::Response, ureq::Error>) -> Result<Answer<Vec<u8>>> {
        let Answer { status, headers, body: mut reader } = self.streamed_answer(result)?;
        let mut body = Vec::new();
        reader.read_to_end(&mut body).map_err(ClientError::io("reading the answer"))?;
        Ok(Answer { status, headers, body })
    }

    fn streamed_answer(&self, result: Result<ureq::Response, ureq::Error>) -> Result<Answer<Box<dyn Read + Send>>> {
        let response = self.any_status(result)?;
        let status = response.status();
        let mut names = response.headers_names();
        names.sort();
        names.dedup();
        let headers = names
            .iter()
            .flat_map(|name| response.all(name).into_iter().map(|value| (name.clone(), value.to_string())))
            .collect();
        Ok(Answer { status, headers, body: Box::new(response.into_reader()) })
    }

    /// A request without a body whose answer is read as it streams (a
    /// followed event stream, SSE or NDJSON, or a command's output): its
    /// status and headers, whatever the status, and its body to read. How
    /// long a silent stream is waited for is the agent's deadline.
    pub fn open(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> Result<Answer<Box<dyn Read + Send>>> {
        self.streamed_answer(self.request_with(method, path, headers).call())
    }

    /// Any request with an optional body of raw bytes and extra headers;
    /// the whole answer, its body as sent, whatever the status (a file's
    /// content, an archive, a refusal of one, another API's answer).
    pub fn call_bytes(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Result<Answer<Vec<u8>>> {
        let request = self.request_with(method, path, headers);
        let result = match body {
            Some(body) => request.send_bytes(body),
            None => request.call(),
        };
        self.bytes_answer(result)
    }

    /// A POST of raw bytes with extra headers; the status and the whole
    /// body, whatever the status (for routes that are not SPACE's own API,
    /// such as the E2B-compatible ones).
    pub fn post_bytes(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<(u16, Vec<u8>)> {
        self.call_bytes("POST", path, headers, Some(body)).map(|answer| (answer.status, answer.body))
    }

    fn any_status(&self, result: Result<ureq::Response, ureq::Error>) -> Result<ureq::Response> {
        match result {
            Ok(response) | Err(ureq::Error::Status(_, response)) => Ok(response),
            Err(err) => Err(ClientError::Unreachable { base: self.base.clone(), source: Box::new(err) }),
        }
    }

    /// A GET of a text body.
    pub fn get_text(&self, path: &str) -> Result<String> {
        self.accept(self.request("GET", path).call())?.into_string().map_err(ClientError::io("reading the answer"))
    }

    // Files: a sandbox's (`FilesOf::Sandbox`) or a volume's, through the
    // same query and answers.

    /// Streams a local file into a sandbox.
    pub fn upload(&self, sandbox: &str, path: &str, mode: &str, file: std::fs::File) -> Result<()> {
        self.upload_to(FilesOf::Sandbox(sandbox), path, Some(mode), file)
    }

    /// Writes `bytes` to `path` in a sandbox.
    pub fn upload_bytes(&self, sandbox: &str, path: &str, bytes: &[u8]) -> Result<()> {
        self.upload_bytes_to(FilesOf::Sandbox(sandbox), path, bytes)
    }

    /// Sends a tar archive to unpack into directory `path` of a sandbox.
    pub fn upload_tar(&self, sandbox: &str, path: &str, archive: Vec<u8>) -> Result<()> {
        self.upload_tar_to(FilesOf::Sandbox(sandbox), path, &archive)
    }

    /// A directory of a sandbox as a tar archive.
    pub fn download_tar(&self, sandbox: &str, path: &str) -> Result<Vec<u8>> {
        self.download_tar_from(FilesOf::Sandbox(sandbox), path)
    }

    /// Whether `path` in a sandbox is a directory.
    pub fn is_dir(&self, sandbox: &str, path: &str) -> Result<bool> {
        self.is_dir_in(FilesOf::Sandbox(sandbox), path)
    }

    /// Streams a file out of a sandbox into `out`.
    pub fn download(&self, sandbox: &str, path: &str, out: &mut impl Write) -> Result<()> {
        self.download_from(FilesOf::Sandbox(sandbox), path, out)
    }

    /// Streams `body` into file `path` (parents made; permission bits
    /// `mode`, octal, when given).
    pub fn upload_to(&self, files: FilesOf<'_>, path: &str, mode: Option<&str>, body: impl Read) -> Result<()> {
        let mut target = files.route(path);
        if let Some(mode) = mode {
            target.push_str(&format!("&mode={}", encode(mode)));
        }
        self.accept(self.request("PUT", &target).send(body)).map(drop)
    }

    /// Writes `bytes` to file `path` (parents made).
    pub fn upload_bytes_to(&self, files: FilesOf<'_>, path: &str, bytes: &[u8]) -> Result<()> {
        self.accept(self.request("PUT", &files.route(path)).send_bytes(bytes)).map(drop)
    }

    /// Sends a tar archive to unpack into directory `path`.
    pub fn upload_tar_to(&self, files: FilesOf<'_>, path: &str, archive: &[u8]) -> Result<()> {
        let target = format!("{}&format=tar", files.route(path));
        self.accept(self.request("PUT", &target).send_bytes(archive)).map(drop)
    }

    /// Directory `path` as a tar archive.
    pub fn download_tar_from(&self, files: FilesOf<'_>, path: &str) -> Result<Vec<u8>> {
        let target = format!("{}&format=tar", files.route(path));
        let response = self.accept(self.request("GET", &target).call())?;
        let mut archive = Vec::new();
        std::io::Read::read_to_end(&mut response.into_reader(), &mut archive)
            .map_err(ClientError::io("receiving the archive"))?;
        Ok(archive)
    }

    /// Whether `path` is a directory.
    pub fn is_dir_in(&self, files: FilesOf<'_>, path: &str) -> Result<bool> {
        Ok(self.accept(self.request("GET", &files.route(path)).call())?.content_type() == "application/json")
    }

    /// Streams file `path` into `out`.
    pub fn download_from(&self, files: FilesOf<'_>, path: &str, out: &mut impl Write) -> Result<()> {
        let response = self.accept(self.request("GET", &files.route(path)).call())?;
        if response.content_type() == "application/json" {
            return Err(ClientError::Protocol(format!("{path} is a directory (download_tar takes directories)")));
        }
        std::io::copy(&mut response.into_reader(), out).map_err(ClientError::io("receiving the file"))?;
        Ok(())
    }

    /// Directory `path`'s listing (`{entries: [...]}`), as the server sent it.
    pub fn list_dir(&self, files: FilesOf<'_>, path: &str) -> Result<Value> {
        let response = self.accept(self.request("GET", &files.route(path)).call())?;
        if response.content_type() != "application/json" {
            return Err(ClientError::Protocol(format!("{path} is a file, not a directory")));
        }
        let text = response.into_string().map_err(ClientError::io("reading the answer"))?;
        serde_json::from_str(&text).map_err(ClientError::decode("reading the answer"))
    }

    /// Removes file or directory `path` (a directory with what it holds
    /// only when `recursive`).
    pub fn remove_file(&self, files: FilesOf<'_>, path: &str, recursive: bool) -> Result<()> {
        let mut target = files.route(path);
        if recursive {
            target.push_str("&recursive=true");
        }
        self.delete_empty(&target)
    }

    // Operations, events and output.

    /// Long-polls an operation until it has ended; it, as the server sent it.
    pub fn wait_operation(&self, id: &str) -> Result<Value> {
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
    pub fn events<E: From<ClientError>>(
        &self,
        query: &str,
        from: Option<u64>,
        follow: bool,
        mut each: impl FnMut(space_api::Event) -> Result<(), E>,
    ) -> Result<(), E> {
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
                    return Err(self.error_of(err).into());
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
                let event: space_api::Event = serde_json::from_str(&line).map_err(ClientError::decode("an event"))?;
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
        let response = self.accept(self.request("GET", &format!("{output_path}?follow=true")).call())?;
        let mut total = 0u64;
        for line in BufReader::with_capacity(1 << 20, response.into_reader()).lines() {
            let line = line.map_err(ClientError::io("reading the output stream"))?;
            match serde_json::from_str::<OutputFrame>(&line).map_err(ClientError::decode("an output frame"))? {
                OutputFrame::Stdout { data, data_b64, .. } | OutputFrame::Stderr { data, data_b64, .. } => {
                    total += frame_bytes(data, data_b64)?.len() as u64;
                }
                OutputFrame::Exit { .. } => return Ok(total),
            }
        }
        Err(ClientError::Protocol("the output stream ended without an exit frame".into()))
    }

    /// Streams a command's output into `stdout` and `stderr` until its exit
    /// frame, re-attaching from the last offset if the stream breaks (each
    /// re-attach is said on `stderr`).
    pub fn stream_output(
        &self,
        output_path: &str,
        stdout: &mut impl Write,
        stderr: &mut impl Write,
    ) -> Result<ProcessResult> {
        let mut offset = 0u64;
        let mut attempts = 0;
        loop {
            let response = match self.request("GET", &format!("{output_path}?from={offset}&follow=true")).call() {
                Ok(response) => response,
                Err(err @ ureq::Error::Status(..)) => return Err(self.error_of(err)),
                Err(err) if attempts < 5 => {
                    attempts += 1;
                    let _ = writeln!(stderr, "space: output stream failed ({err}); re-attaching at offset {offset}");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
                Err(err) => return Err(self.error_of(err)),
            };
            for line in BufReader::new(response.into_reader()).lines() {
                let Ok(line) = line else { break };
                let frame: OutputFrame = serde_json::from_str(&line).map_err(ClientError::decode("an output frame"))?;
                match frame {
                    OutputFrame::Stdout { offset: at, data, data_b64 } => {
                        let bytes = frame_bytes(data, data_b64)?;
                        offset = at + bytes.len() as u64;
                        stdout
                            .write_all(&bytes)
                            .and_then(|()| stdout.flush())
                            .map_err(ClientError::io("writing the output"))?;
                    }
                    OutputFrame::Stderr { offset: at, data, data_b64 } => {
                        let bytes = frame_bytes(data, data_b64)?;
                        offset = at + bytes.len() as u64;
                        stderr.write_all(&bytes).map_err(ClientError::io("writing the output"))?;
                    }
                    OutputFrame::Exit { result } => return Ok(result),
                }
            }
            attempts += 1;
            if attempts > 5 {
                return Err(ClientError::Protocol("the output stream kept breaking before the exit frame".into()));
            }
            let _ = writeln!(stderr, "space: output stream ended early; re-attaching at offset {offset}");
        }
    }
}

/// Whose files a files call is on: the routes of a sandbox's files and of
/// a volume's take the same query and give the same answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilesOf<'a> {
    /// A sandbox, by id.
    Sandbox(&'a str),
    /// A volume of the caller's, by name (no sandbox needed).
    Volume(&'a str),
}

impl FilesOf<'_> {
    /// The files route with `path` in its query (more `&key=value` may follow).
    fn route(&self, path: &str) -> String {
        match self {
            FilesOf::Sandbox(id) => format!("/v1/sandboxes/{}/files?path={}", encode(id), encode(path)),
            FilesOf::Volume(name) => format!("/v1/volumes/{}/files?path={}", encode(name), encode(path)),
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
        (None, Some(b64)) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| ClientError::Protocol(format!("an output frame's base64: {e}"))),
        (None, None) => Ok(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;

    use super::*;

    /// A server on loopback that answers each of `answers` to one request,
    /// in order, and hands back each request it read (its head, then its
    /// body). Each answer names its place in `answers` in `X-Answer`.
    fn serve(answers: Vec<(u16, String)>) -> (String, std::thread::JoinHandle<Vec<String>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        // Each request is waited for with a deadline: a client that never
        // calls fails the test rather than hanging its join.
        listener.set_nonblocking(true).unwrap();
        let served = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for (i, (status, body)) in answers.into_iter().enumerate() {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                let socket = loop {
                    match listener.accept() {
                        Ok((socket, _)) => break socket,
                        Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                            assert!(std::time::Instant::now() < deadline, "no request within 10 s");
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(err) => panic!("accepting: {err}"),
                    }
                };
                socket.set_nonblocking(false).unwrap();
                socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut reader = BufReader::new(socket);
                let mut head = String::new();
                while !head.ends_with("\r\n\r\n") && reader.read_line(&mut head).unwrap() > 0 {}
                let lower = head.to_ascii_lowercase();
                let mut request_body = Vec::new();
                if lower.contains("transfer-encoding: chunked") {
                    // A streamed body: chunks, each its size in hex first, to one of size 0.
                    loop {
                        let mut size = String::new();
                        reader.read_line(&mut size).unwrap();
                        let size = usize::from_str_radix(size.trim(), 16).unwrap();
                        let mut chunk = vec![0u8; size + 2];
                        reader.read_exact(&mut chunk).unwrap();
                        if size == 0 {
                            break;
                        }
                        request_body.extend_from_slice(&chunk[..size]);
                    }
                } else {
                    let length: usize = lower
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().to_string()))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    request_body.resize(length, 0);
                    reader.read_exact(&mut request_body).unwrap();
                }
                seen.push(format!("{head}{}", String::from_utf8_lossy(&request_body)));
                let answer = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nX-Answer: {i}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                reader.into_inner().write_all(answer.as_bytes()).unwrap();
            }
            seen
        });
        (base, served)
    }

    fn client(base: &str) -> Client {
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(10)).build();
        Client::with_agent(base, "key", agent)
    }

    #[test]
    fn an_error_answer_carries_its_typed_code_status_and_details() {
        let (base, served) = serve(vec![
            (
                429,
                r#"{"error":{"code":"quota_exceeded","message":"past 2 sandboxes","details":{"resource":"sandboxes"}}}"#
                    .into(),
            ),
            (409, r#"{"error":{"code":"a_code_from_a_newer_server","message":"later","details":{}}}"#.into()),
        ]);
        let client = client(&base);
        let err = client.sandbox("sbx_1").unwrap_err();
        assert_eq!((err.status(), err.code()), (Some(429), Some(ErrorCode::QuotaExceeded)), "{err}");
        assert_eq!(err.to_string(), "HTTP 429 quota_exceeded: past 2 sandboxes");
        let ClientError::Api { details, .. } = &err else { panic!("{err:?}") };
        assert_eq!(details["resource"], "sandboxes");
        // A code this client does not know: the status still says what kind.
        let err = client.get("/v1/sandboxes").unwrap_err();
        assert_eq!((err.status(), err.code()), (Some(409), None), "{err}");
        let seen = served.join().unwrap();
        assert!(seen[0].starts_with("GET /v1/sandboxes/sbx_1 HTTP/1.1"), "{seen:?}");
    }

    #[test]
    fn typed_calls_send_and_read_the_apis_own_types() {
        let result = ProcessResult {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            oom_killed: false,
            duration_ms: 3,
            stdout_bytes: 3,
            stderr_bytes: 0,
            finished_at: space_api::Timestamp::parse("2026-01-01T00:00:00Z").unwrap(),
            error: None,
        };
        let command = space_api::Command {
            id: "cmd_1".into(),
            sandbox_id: "sbx_1".into(),
            state: space_api::CommandState::Exited,
            argv: vec!["echo".into(), "hi".into()],
            pid: 7,
            tag: None,
            started_at: space_api::Timestamp::parse("2026-01-01T00:00:00Z").unwrap(),
            attach: space_api::Attach { output: "/o".into(), stdin: "/i".into(), ws: "/w".into() },
            stdin: None,
            tty: None,
            result: Some(result.clone()),
        };
        let answer = ExecResponse { command, stdout: "hi\n".into(), stderr: String::new(), result, truncated: false };
        let exec = serde_json::to_string(&answer).unwrap();
        let (base, served) = serve(vec![(200, exec)]);
        let request = CommandRequest { argv: Some(vec!["echo".into(), "hi".into()]), ..CommandRequest::default() };
        let ran = client(&base).exec("sbx_1", &request).unwrap();
        assert_eq!((ran.stdout.as_str(), ran.result.exit_code), ("hi\n", Some(0)));
        let seen = served.join().unwrap();
        assert!(seen[0].starts_with("POST /v1/sandboxes/sbx_1/exec HTTP/1.1"), "{seen:?}");
        assert!(seen[0].contains(r#""argv":["echo","hi"]"#), "{seen:?}");
    }

    #[test]
    fn no_server_is_unreachable_not_an_answer() {
        // A port just freed: nothing listens there.
        let base = {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", listener.local_addr().unwrap())
        };
        let err = client(&base).get("/v1/health").unwrap_err();
        assert!(matches!(err, ClientError::Unreachable { .. }), "{err:?}");
        assert_eq!((err.status(), err.code()), (None, None));
    }

    #[test]
    fn a_call_with_headers_reads_the_whole_answer_whatever_its_status() {
        let refused = r#"{"error":{"code":"quota_exceeded","message":"past 1 sandbox","details":{}}}"#;
        let (base, served) = serve(vec![(429, refused.into()), (204, String::new())]);
        let client = client(&base);
        let body = serde_json::json!({"template": "base"});
        let answer = client.call_with("POST", "/v1/sandboxes", &[("Idempotency-Key", "k-1")], Some(&body)).unwrap();
        assert_eq!((answer.status, answer.header("x-answer")), (429, Some("0")), "{answer:?}");
        // Read as a failed typed call reads it.
        let err = ClientError::from_answer(answer.status, &answer.body);
        assert_eq!((err.status(), err.code()), (Some(429), Some(ErrorCode::QuotaExceeded)), "{err}");
        // No body (a 204) is null, not an error.
        let answer = client.call_with("DELETE", "/v1/secrets/s", &[], None).unwrap();
        assert_eq!((answer.status, &answer.body, answer.header("X-ANSWER")), (204, &Value::Null, Some("1")));
        let seen = served.join().unwrap();
        assert!(seen[0].starts_with("POST /v1/sandboxes HTTP/1.1"), "{seen:?}");
        assert!(seen[0].to_ascii_lowercase().contains("\r\nidempotency-key: k-1\r\n"), "{seen:?}");
        assert!(seen[0].ends_with(r#"{"template":"base"}"#), "{seen:?}");
    }

    #[test]
    fn a_streamed_body_is_sent_with_its_content_type() {
        let (base, served) = serve(vec![(202, r#"{"operation":{"id":"op_1"}}"#.into())]);
        let archive: &[u8] = b"not really a tar";
        let answer = client(&base)
            .send_with("POST", "/v1/templates?name=t", &[("Content-Type", "application/x-tar")], archive)
            .unwrap();
        assert_eq!((answer.status, &answer.body["operation"]["id"]), (202, &Value::from("op_1")), "{answer:?}");
        let seen = served.join().unwrap();
        assert!(seen[0].starts_with("POST /v1/templates?name=t HTTP/1.1"), "{seen:?}");
        assert!(seen[0].to_ascii_lowercase().contains("\r\ncontent-type: application/x-tar\r\n"), "{seen:?}");
        assert!(seen[0].ends_with("\r\n\r\nnot really a tar"), "{seen:?}");
    }

    #[test]
    fn a_bytes_call_sends_and_reads_bodies_as_they_are() {
        let (base, served) = serve(vec![(201, "not json \u{1}".into()), (400, "refused".into())]);
        let client = client(&base);
        let path = "/v1/sandboxes/sbx_1/files?path=/a";
        let put = client.call_bytes("PUT", path, &[("X-Note", "n")], Some(b"\0raw")).unwrap();
        assert_eq!((put.status, put.body.as_slice(), put.header("X-Answer")), (201, &b"not json \x01"[..], Some("0")));
        // Any status, its body kept, JSON or not.
        let get = client.call_bytes("GET", "/v1/x", &[], None).unwrap();
        assert_eq!((get.status, get.body.as_slice()), (400, &b"refused"[..]));
        let seen = served.join().unwrap();
        assert!(seen[0].starts_with("PUT /v1/sandboxes/sbx_1/files?path=/a HTTP/1.1"), "{seen:?}");
        let head = seen[0].to_ascii_lowercase();
        assert!(head.contains("\r\ncontent-length: 4\r\n") && head.contains("\r\nx-note: n\r\n"), "{seen:?}");
        assert!(seen[0].ends_with("\r\n\r\n\0raw"), "{seen:?}");
        assert!(seen[1].starts_with("GET /v1/x HTTP/1.1") && seen[1].ends_with("\r\n\r\n"), "{seen:?}");
    }

    #[test]
    fn a_client_with_another_key_calls_the_same_server_with_that_key() {
        let (base, served) = serve(vec![(200, "{}".into()), (200, "{}".into())]);
        let ours = client(&base);
        let theirs = ours.with_key("tenant-b");
        theirs.get("/v1/usage").unwrap();
        ours.get("/v1/usage").unwrap();
        assert_eq!((theirs.base(), theirs.key(), ours.key()), (base.as_str(), "tenant-b", "key"));
        let seen = served.join().unwrap();
        assert!(seen[0].to_ascii_lowercase().contains("\r\nauthorization: bearer tenant-b\r\n"), "{seen:?}");
        assert!(seen[1].to_ascii_lowercase().contains("\r\nauthorization: bearer key\r\n"), "{seen:?}");
    }

    #[test]
    fn a_client_with_a_deadline_gives_up_on_a_server_that_never_answers() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        listener.set_nonblocking(true).unwrap();
        // Takes the request and says nothing, until the client hangs up
        // (or 30 s pass, so a client that never does fails the test).
        let silent = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut socket = loop {
                match listener.accept() {
                    Ok((socket, _)) => break socket,
                    Err(err) if err.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(err) => panic!("no request: {err}"),
                }
            };
            socket.set_nonblocking(false).unwrap();
            socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let _ = socket.read_to_end(&mut Vec::new());
        });
        let started = Instant::now();
        let err = Client::with_deadline(&base, "key", Duration::from_millis(300)).get("/v1/health").unwrap_err();
        assert!(matches!(err, ClientError::Unreachable { .. }), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "gave up after {:?}", started.elapsed());
        silent.join().unwrap();
    }

    #[test]
    fn an_opened_stream_is_read_while_the_server_still_sends_it() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (read_first, first_was_read) = std::sync::mpsc::channel::<()>();
        // Sends one event, then waits for the client to have read it before
        // sending the next: a client that waited for the whole body would
        // never see the first one.
        let server = std::thread::spawn(move || {
            let (socket, _) = listener.accept().unwrap();
            socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut reader = BufReader::new(socket);
            let mut head = String::new();
            while !head.ends_with("\r\n\r\n") && reader.read_line(&mut head).unwrap() > 0 {}
            let mut socket = reader.into_inner();
            let chunk = |text: &str| format!("{:x}\r\n{text}\r\n", text.len());
            let first = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
            socket.write_all(format!("{first}{}", chunk("id: 1\ndata: {}\n\n")).as_bytes()).unwrap();
            let seen = first_was_read.recv_timeout(Duration::from_secs(10));
            socket.write_all(format!("{}0\r\n\r\n", chunk("id: 2\ndata: {}\n\n")).as_bytes()).unwrap();
            seen.expect("the client read the first event before the second was sent");
            head
        });
        let answer = client(&base).open("GET", "/v1/events?follow=true", &[("Accept", "text/event-stream")]).unwrap();
        assert_eq!((answer.status, answer.header("Content-Type")), (200, Some("text/event-stream")));
        let mut lines = BufReader::new(answer.body).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "id: 1");
        read_first.send(()).unwrap();
        let rest: Vec<String> = lines.map(Result::unwrap).collect();
        assert_eq!(rest, ["data: {}", "", "id: 2", "data: {}", ""]);
        let head = server.join().unwrap();
        assert!(head.starts_with("GET /v1/events?follow=true HTTP/1.1"), "{head}");
        assert!(head.to_ascii_lowercase().contains("\r\naccept: text/event-stream\r\n"), "{head}");
    }

    #[test]
    fn an_opened_stream_that_is_refused_keeps_its_status_and_body() {
        let refused = r#"{"error":{"code":"not_found","message":"no such command","details":{}}}"#;
        let (base, served) = serve(vec![(404, refused.into())]);
        let answer = client(&base).open("GET", "/v1/sandboxes/sbx_1/commands/cmd_1/output", &[]).unwrap();
        let status = answer.status;
        let mut body = String::new();
        { answer.body }.read_to_string(&mut body).unwrap();
        assert_eq!((status, body.as_str()), (404, refused));
        served.join().unwrap();
    }

    fn operation(state: &str) -> String {
        serde_json::json!({"id": "op_1", "kind": "create", "state": state,
            "progress": {"step": "starting", "done": 0, "total": 1}, "created_at": "2026-01-01T00:00:00Z"})
        .to_string()
    }

    #[test]
    fn waiting_for_an_operation_stops_at_its_end_or_at_the_patience() {
        let (base, served) = serve(vec![(200, operation("running")), (200, operation("succeeded"))]);
        let ended = client(&base).wait_for_operation_within("op_1", Duration::from_secs(300)).unwrap();
        assert_eq!(ended.state, OperationState::Succeeded);
        let seen = served.join().unwrap();
        assert!(seen.iter().all(|s| s.starts_with("GET /v1/operations/op_1?wait=30 ")), "{seen:?}");
        // Out of patience: one poll that does not wait, and the operation as it was.
        let (base, served) = serve(vec![(200, operation("running"))]);
        let running = client(&base).wait_for_operation_within("op_1", Duration::ZERO).unwrap();
        assert_eq!(running.state, OperationState::Running);
        let seen = served.join().unwrap();
        assert!(seen[0].starts_with("GET /v1/operations/op_1?wait=0 "), "{seen:?}");
    }

    #[test]
    fn query_paths_are_percent_encoded() {
        assert_eq!(encode("/root/a b&c=d.txt"), "/root/a%20b%26c%3Dd.txt");
    }
}
