//! The control plane's own calls to a node, typed in and out with
//! `space_api`'s types: the lists and usage it gathers, a sandbox it looks
//! up, the feed of events it follows, the template pulls and secrets it
//! sends, the 202 answers it records placements from, and what a volume's
//! placement and move ask of a node (its free disk, a volume, its files as
//! a tar).
//!
//! A user's request sent on to its node is not one of these: it is
//! relayed as it came (`forward.rs`), bytes and upgrades alike; only when
//! the control plane reads the node's answer itself does it read it here,
//! as the type the node's handler answers with. An answer that does not
//! read as that type is an error saying so, never a default.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::Response;
use serde::de::DeserializeOwned;
use serde::Serialize;
use space_api::cluster::{
    DiskAllowance, FeedEvent, HandedVolume, PullRequest, ReleaseVolume, EVENTS_PATH, SECRETS_PATH, TEMPLATE_PULL_PATH,
    VOLUME_ADOPT_PATH, VOLUME_RELEASE_PATH,
};
use space_api::e2b::{CreatedSandbox, ListedSandbox};
use space_api::{
    CreateVolumeRequest, ErrorBody, ErrorCode, ForkAccepted, Health, Operation, OperationList, Sandbox, SandboxList,
    SandboxOperation, TemplateList, TemplateOperation, Usage, Volume, VolumeList,
};
use space_core::secrets::SecretSet;
use space_core::tenants::Caller;
use space_store::NodeRow;

use crate::error::ControlError;
use crate::forward::forward;
use crate::state::ControlPlane;

/// The largest answer the control plane reads whole.
const MAX_READ: usize = 4 << 20;

/// Why a call to a node did not give what the control plane asked for.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// It could not be reached (or the request not made).
    #[error("{}", .0.message)]
    Unreachable(ControlError),
    /// It answered with an error of its own, passed on as it said it.
    #[error("{}", .0.message)]
    Refused(ControlError),
    /// It answered a status its handler does not answer with success.
    #[error("{what}: it answered {status}")]
    Status { what: &'static str, status: StatusCode },
    #[error("{what}: reading its answer: {source}")]
    Read {
        what: &'static str,
        #[source]
        source: axum::Error,
    },
    /// Its answer is not the type its handler answers with: the two sides
    /// disagree on the wire (a node of another version, or a bug).
    #[error("{what}: its answer is not {expected}: {source}")]
    Shape {
        what: &'static str,
        expected: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// What a node that accepted a lifecycle request answers (202), by the
/// request: the handlers answer `SandboxOperation` for a create, a
/// pause/resume/suspend/delete and a checkpoint's save or restore,
/// `ForkAccepted` for a fork and `TemplateOperation` for a build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    Sandbox,
    Fork,
    Template,
}

/// A node's 202, read as the type [`Expect`] names.
#[derive(Debug)]
pub(crate) enum Accepted {
    Sandbox(SandboxOperation),
    Fork(ForkAccepted),
    Template(TemplateOperation),
}

impl Accepted {
    pub(crate) fn operation(&self) -> &Operation {
        match self {
            Accepted::Sandbox(answer) => &answer.operation,
            Accepted::Fork(answer) => &answer.operation,
            Accepted::Template(answer) => &answer.operation,
        }
    }

    /// The sandboxes it places: a lifecycle's sandbox, or a fork's new
    /// ones (on the source's node).
    pub(crate) fn sandboxes(&self) -> &[Sandbox] {
        match self {
            Accepted::Sandbox(answer) => std::slice::from_ref(&answer.sandbox),
            Accepted::Fork(answer) => &answer.sandboxes,
            Accepted::Template(_) => &[],
        }
    }
}

/// One node, as the control plane calls it.
pub(crate) struct NodeClient<'a> {
    cp: &'a ControlPlane,
    node: &'a NodeRow,
}

impl<'a> NodeClient<'a> {
    pub(crate) fn new(cp: &'a ControlPlane, node: &'a NodeRow) -> NodeClient<'a> {
        NodeClient { cp, node }
    }

    /// `GET /v1/sandboxes?QUERY` as `caller` (the query as the caller sent it).
    pub(crate) async fn list_sandboxes(&self, caller: &Caller, query: Option<&str>) -> Result<SandboxList, CallError> {
        self.get(caller, &with_query("/v1/sandboxes", query), "listing its sandboxes", "a SandboxList").await
    }

    /// `GET /v1/operations?QUERY` as `caller`.
    pub(crate) async fn list_operations(
        &self,
        caller: &Caller,
        query: Option<&str>,
    ) -> Result<OperationList, CallError> {
        self.get(caller, &with_query("/v1/operations", query), "listing its operations", "an OperationList").await
    }

    /// `GET /v1/templates` as `caller`.
    pub(crate) async fn list_templates(&self, caller: &Caller) -> Result<TemplateList, CallError> {
        self.get(caller, "/v1/templates", "listing its templates", "a TemplateList").await
    }

    /// `GET /v1/usage`: what `caller`'s tenant holds there.
    pub(crate) async fn usage(&self, caller: &Caller) -> Result<Usage, CallError> {
        self.get(caller, "/v1/usage", "its usage", "a Usage").await
    }

    /// `GET /v1/sandboxes/{id}` as `caller`; `None` if the node has no such
    /// sandbox (deleted there).
    pub(crate) async fn sandbox(&self, caller: &Caller, id: &str) -> Result<Option<Sandbox>, CallError> {
        let response = self.send(caller, get(&format!("/v1/sandboxes/{id}"))?).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        read_ok(response, "a sandbox", "a Sandbox").await.map(Some)
    }

    /// `GET /v1/health`: what it runs and its free disk.
    pub(crate) async fn health(&self) -> Result<Health, CallError> {
        self.get(&Caller::operator(), "/v1/health", "its health", "a Health").await
    }

    /// `GET /v1/volumes` as `caller`.
    pub(crate) async fn list_volumes(&self, caller: &Caller) -> Result<VolumeList, CallError> {
        self.get(caller, "/v1/volumes", "listing its volumes", "a VolumeList").await
    }

    /// `GET /v1/volumes/{name}` as `caller`; `None` if the node has no such
    /// volume.
    pub(crate) async fn volume(&self, caller: &Caller, name: &str) -> Result<Option<Volume>, CallError> {
        let response = self.send(caller, get(&volume_path(name, ""))?).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        read_ok(response, "a volume", "a Volume").await.map(Some)
    }

    /// `POST /v1/volumes` as `caller`, with the tenant's disk allowance.
    pub(crate) async fn create_volume(
        &self,
        caller: &Caller,
        create: &CreateVolumeRequest,
        allowance: DiskAllowance,
    ) -> Result<Volume, CallError> {
        let mut request = json_request("POST", "/v1/volumes", create)?;
        request.extensions_mut().insert(allowance);
        let response = self.send(caller, request).await?;
        read_ok(response, "making a volume", "a Volume").await
    }

    /// `DELETE /v1/volumes/{name}` as `caller`.
    pub(crate) async fn delete_volume(&self, caller: &Caller, name: &str) -> Result<(), CallError> {
        let request = Request::delete(volume_path(name, ""))
            .body(Body::empty())
            .map_err(|e| CallError::Unreachable(ControlError::internal("a request to a node", e)))?;
        let response = self.send(caller, request).await?;
        if !response.status().is_success() {
            return Err(refusal(response, "deleting a volume").await);
        }
        Ok(())
    }

    /// `GET /v1/volumes/{name}/files?path=/&format=tar` as `caller`: the
    /// whole volume as a tar, its body unread (to stream on).
    pub(crate) async fn volume_tar(&self, caller: &Caller, name: &str) -> Result<Body, CallError> {
        let response = self.send(caller, get(&volume_path(name, "/files?path=/&format=tar"))?).await?;
        if response.status() != StatusCode::OK {
            return Err(refusal(response, "reading a volume's files").await);
        }
        Ok(response.into_body())
    }

    /// `PUT /v1/volumes/{name}/files?path=/&format=tar` as `caller`: `tar`
    /// unpacked into the volume, streamed as it comes.
    pub(crate) async fn put_volume_tar(&self, caller: &Caller, name: &str, tar: Body) -> Result<(), CallError> {
        let request = Request::put(volume_path(name, "/files?path=/&format=tar"))
            .header(header::CONTENT_TYPE, "application/x-tar")
            .body(tar)
            .map_err(|e| CallError::Unreachable(ControlError::internal("a request to a node", e)))?;
        let response = self.send(caller, request).await?;
        if !response.status().is_success() {
            return Err(refusal(response, "writing a volume's files").await);
        }
        Ok(())
    }

    /// E2B's `GET /e2b/.../sandboxes?QUERY` as `caller` (`path_and_query`
    /// as E2B's SDK sent it, but for its paging: the control plane pages
    /// the whole cluster's). A refusal is E2B's shape, not SPACE's: it is
    /// handed back as the node answered it, to pass on.
    pub(crate) async fn e2b_list(
        &self,
        caller: &Caller,
        path_and_query: &str,
    ) -> Result<Result<Vec<ListedSandbox>, Response>, CallError> {
        let response = self.send(caller, get(path_and_query)?).await?;
        if !response.status().is_success() {
            return Ok(Err(response));
        }
        let (_, listed) = read_kept(response, "its E2B sandboxes", "a list of E2B's ListedSandbox").await?;
        Ok(Ok(listed))
    }

    /// `POST /internal/v1/volumes/release`: the node lets go of `caller`'s
    /// volume `name` of the shared store, for another to take.
    pub(crate) async fn release_volume(&self, caller: &Caller, name: &str) -> Result<HandedVolume, CallError> {
        let body = ReleaseVolume { tenant: caller.tenant.clone(), name: name.to_string() };
        let response = self.send(&Caller::operator(), json_request("POST", VOLUME_RELEASE_PATH, &body)?).await?;
        read_ok(response, "releasing a volume", "a HandedVolume").await
    }

    /// `POST /internal/v1/volumes/adopt`: the node takes a volume another
    /// let go of.
    pub(crate) async fn adopt_volume(&self, handed: &HandedVolume) -> Result<Volume, CallError> {
        let response = self.send(&Caller::operator(), json_request("POST", VOLUME_ADOPT_PATH, handed)?).await?;
        read_ok(response, "taking a volume", "a Volume").await
    }

    /// `POST /internal/v1/templates/pull`: fetch `pull.name` from another
    /// node (the node answers at once and pulls in the background).
    pub(crate) async fn pull_template(&self, pull: &PullRequest) -> Result<(), CallError> {
        self.post(TEMPLATE_PULL_PATH, pull, "asking for a template pull").await
    }

    /// `POST /internal/v1/secrets`: the cluster's secrets as of now.
    pub(crate) async fn put_secrets(&self, set: &SecretSet) -> Result<(), CallError> {
        self.post(SECRETS_PATH, set, "sending the secrets").await
    }

    /// `GET /internal/v1/events?after=N`: its events after `after`, then
    /// each as it commits.
    pub(crate) async fn feed(&self, after: u64) -> Result<Feed, CallError> {
        let response = self.send(&Caller::operator(), get(&format!("{EVENTS_PATH}?after={after}"))?).await?;
        if response.status() != StatusCode::OK {
            return Err(refusal(response, "its events").await);
        }
        Ok(Feed { body: response.into_body().into_data_stream(), pending: Vec::new() })
    }

    /// A lifecycle request's answer, relayed: a 202 is read as `expect`
    /// says its handler answers, and handed back with the answer to pass
    /// on (the bytes as the node sent them); any other answer is passed on
    /// unread.
    pub(crate) async fn accepted(
        &self,
        response: Response,
        expect: Expect,
    ) -> Result<(Response, Option<Accepted>), CallError> {
        if response.status() != StatusCode::ACCEPTED {
            return Ok((response, None));
        }
        let (response, accepted) = match expect {
            Expect::Sandbox => {
                let (response, answer) = read_kept(response, "its 202", "a SandboxOperation").await?;
                (response, Accepted::Sandbox(answer))
            }
            Expect::Fork => {
                let (response, answer) = read_kept(response, "its 202", "a ForkAccepted").await?;
                (response, Accepted::Fork(answer))
            }
            Expect::Template => {
                let (response, answer) = read_kept(response, "its 202", "a TemplateOperation").await?;
                (response, Accepted::Template(answer))
            }
        };
        Ok((response, Some(accepted)))
    }

    /// E2B's create's answer (201), read to record its sandbox, and the
    /// answer to pass on as sent; any other answer unread.
    pub(crate) async fn e2b_created(
        &self,
        response: Response,
    ) -> Result<(Response, Option<CreatedSandbox>), CallError> {
        if !response.status().is_success() {
            return Ok((response, None));
        }
        let (response, created) = read_kept(response, "its E2B create", "E2B's Sandbox").await?;
        Ok((response, Some(created)))
    }

    /// The node's id, to say which node an error is about.
    pub(crate) fn id(&self) -> &str {
        &self.node.id
    }

    async fn send(&self, caller: &Caller, request: Request) -> Result<Response, CallError> {
        forward(self.cp, self.node, caller, request).await.map_err(CallError::Unreachable)
    }

    async fn get<T: DeserializeOwned>(
        &self,
        caller: &Caller,
        path_and_query: &str,
        what: &'static str,
        expected: &'static str,
    ) -> Result<T, CallError> {
        let response = self.send(caller, get(path_and_query)?).await?;
        read_ok(response, what, expected).await
    }

    /// A POST of `body` as JSON, as the operator; a success answer's body
    /// (none, or an acknowledgement) is not read.
    async fn post(&self, path: &str, body: &impl Serialize, what: &'static str) -> Result<(), CallError> {
        let response = self.send(&Caller::operator(), json_request("POST", path, body)?).await?;
        if !response.status().is_success() {
            return Err(refusal(response, what).await);
        }
        Ok(())
    }
}

impl CallError {
    /// As the control plane answers it: a node's own refusal as the node
    /// said it; anything else as the node being unusable (502), naming it.
    pub(crate) fn into_control(self, node: &str) -> ControlError {
        match self {
            CallError::Refused(err) => err,
            CallError::Unreachable(err) => err,
            other => ControlError::new(ErrorCode::NodeUnreachable, format!("node {node}: {other}")),
        }
    }
}

/// A node's event feed, one batch of whole lines at a time.
pub(crate) struct Feed {
    body: axum::body::BodyDataStream,
    pending: Vec<u8>,
}

impl Feed {
    /// The next events it sent (`None` once the feed ended).
    pub(crate) async fn next_batch(&mut self) -> Option<Result<Vec<FeedEvent>, CallError>> {
        use futures_util::StreamExt as _;
        loop {
            let chunk = match self.body.next().await? {
                Ok(chunk) => chunk,
                Err(source) => return Some(Err(CallError::Read { what: "its events", source })),
            };
            self.pending.extend_from_slice(&chunk);
            let Some(end) = self.pending.iter().rposition(|b| *b == b'\n') else {
                continue;
            };
            let complete: Vec<u8> = self.pending.drain(..=end).collect();
            let events = complete
                .split(|b| *b == b'\n')
                .filter(|line| !line.is_empty())
                .map(serde_json::from_slice::<FeedEvent>)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|source| CallError::Shape { what: "its events", expected: "a FeedEvent line", source });
            return Some(events);
        }
    }
}

fn get(path_and_query: &str) -> Result<Request, CallError> {
    Request::get(path_and_query)
        .body(Body::empty())
        .map_err(|e| CallError::Unreachable(ControlError::bad_request(format!("{path_and_query:?}: {e}"))))
}

/// `/v1/volumes/{name}` and what follows (`rest`); `name` as the node
/// recorded it (of `a-z`, `0-9`, `-` and `_`: nothing to escape).
fn volume_path(name: &str, rest: &str) -> String {
    format!("/v1/volumes/{name}{rest}")
}

fn json_request(method: &str, path: &str, body: &impl Serialize) -> Result<Request, CallError> {
    let body = serde_json::to_vec(body)
        .map_err(|e| CallError::Unreachable(ControlError::internal("writing a request to a node", e)))?;
    Request::builder()
        .method(method)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .map_err(|e| CallError::Unreachable(ControlError::internal("a request to a node", e)))
}

fn with_query(path: &str, query: Option<&str>) -> String {
    match query.filter(|q| !q.is_empty()) {
        Some(query) => format!("{path}?{query}"),
        None => path.to_string(),
    }
}

/// A success answer read as a `T`; another answer as the node's refusal.
async fn read_ok<T: DeserializeOwned>(
    response: Response,
    what: &'static str,
    expected: &'static str,
) -> Result<T, CallError> {
    if !response.status().is_success() {
        return Err(refusal(response, what).await);
    }
    let bytes = read_body(response.into_body(), what).await?;
    serde_json::from_slice(&bytes).map_err(|source| CallError::Shape { what, expected, source })
}

/// An answer read as a `T`, and the same answer to pass on.
async fn read_kept<T: DeserializeOwned>(
    response: Response,
    what: &'static str,
    expected: &'static str,
) -> Result<(Response, T), CallError> {
    let (parts, body) = response.into_parts();
    let bytes = read_body(body, what).await?;
    let answer = serde_json::from_slice(&bytes).map_err(|source| CallError::Shape { what, expected, source })?;
    Ok((Response::from_parts(parts, Body::from(bytes)), answer))
}

async fn read_body(body: Body, what: &'static str) -> Result<axum::body::Bytes, CallError> {
    axum::body::to_bytes(body, MAX_READ).await.map_err(|source| CallError::Read { what, source })
}

/// A node's error answer: its own code and message when it wrote one (as
/// every handler does), else its status.
async fn refusal(response: Response, what: &'static str) -> CallError {
    let status = response.status();
    let retry_after =
        response.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u32>().ok());
    let Ok(bytes) = axum::body::to_bytes(response.into_body(), MAX_READ).await else {
        return CallError::Status { what, status };
    };
    match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(ErrorBody { error }) => {
            let mut err = ControlError::new(error.code, error.message).with_details(error.details);
            if let Some(seconds) = retry_after {
                err = err.retry_after(seconds);
            }
            CallError::Refused(err)
        }
        Err(_) => CallError::Status { what, status },
    }
}
