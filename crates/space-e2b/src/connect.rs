//! The Connect protocol as E2B's SDK speaks it: the JSON codec only, no
//! compression. Unary calls are plain JSON both ways; streams are
//! envelopes (1 flag byte, a 4-byte big-endian length, the JSON message)
//! that end with an end-of-stream envelope carrying the error, if any.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// The content type of a stream, exactly: the SDK refuses any other.
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";
const FLAG_COMPRESSED: u8 = 0x01;
const FLAG_END: u8 = 0x02;
/// The largest message a client may send.
pub const MAX_MESSAGE: usize = 8 << 20;

/// A Connect error: a code from Connect's list and a message.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> RpcError {
        RpcError { code, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new("invalid_argument", message)
    }

    pub fn not_found(message: impl Into<String>) -> RpcError {
        RpcError::new("not_found", message)
    }

    /// The HTTP status Connect gives the code.
    pub fn status(&self) -> StatusCode {
        let code = match self.code {
            "canceled" => 499,
            "invalid_argument" | "failed_precondition" | "out_of_range" => 400,
            "unauthenticated" => 401,
            "permission_denied" => 403,
            "not_found" => 404,
            "already_exists" | "aborted" => 409,
            "resource_exhausted" => 429,
            "unimplemented" => 501,
            "unavailable" => 503,
            "deadline_exceeded" => 504,
            _ => 500,
        };
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    pub fn to_json(&self) -> Value {
        json!({"code": self.code, "message": self.message})
    }
}

impl From<space_node::NodeError> for RpcError {
    fn from(err: space_node::NodeError) -> RpcError {
        let code = match err.code.http_status() {
            400 | 422 => "invalid_argument",
            401 => "unauthenticated",
            403 => "permission_denied",
            404 => "not_found",
            409 => "failed_precondition",
            413 | 429 | 507 => "resource_exhausted",
            503 => "unavailable",
            _ => "internal",
        };
        RpcError::new(code, err.message)
    }
}

/// A unary error (or a stream's, before any message).
impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.to_json())).into_response()
    }
}

/// One envelope.
fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.into()
}

/// A message envelope.
pub fn message(value: &Value) -> Bytes {
    envelope(0, value.to_string().as_bytes())
}

/// The end-of-stream envelope: `{}`, or the error that ended the stream.
pub fn end(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        Some(error) => json!({"error": error.to_json()}),
        None => json!({}),
    };
    envelope(FLAG_END, body.to_string().as_bytes())
}

/// A streaming response whose envelopes come from `frames` as they are
/// produced (each is written and flushed on its own). An `Err` breaks the
/// response off where it is, with no end-of-stream envelope: what envd's
/// clients see when the sandbox under a stream goes away.
pub fn stream_response(frames: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Response {
    let body = Body::from_stream(futures_util::stream::unfold(frames, |mut frames| async move {
        let frame = frames.recv().await?;
        Some((frame, frames))
    }));
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_CONTENT_TYPE));
    response
}

/// Reads a client's envelopes one at a time from a request body.
pub struct Envelopes {
    body: axum::body::BodyDataStream,
    buffer: Vec<u8>,
    ended: bool,
}

impl Envelopes {
    pub fn new(body: Body) -> Envelopes {
        Envelopes { body: body.into_data_stream(), buffer: Vec::new(), ended: false }
    }

    /// The next message; `None` at the end of the stream.
    pub async fn next(&mut self) -> Result<Option<Value>, RpcError> {
        loop {
            if self.buffer.len() >= 5 {
                let flags = self.buffer[0];
                let len = u32::from_be_bytes([self.buffer[1], self.buffer[2], self.buffer[3], self.buffer[4]]) as usize;
                if len > MAX_MESSAGE {
                    return Err(RpcError::new(
                        "resource_exhausted",
                        format!("a message may be at most {MAX_MESSAGE} bytes"),
                    ));
                }
                if self.buffer.len() >= 5 + len {
                    let payload: Vec<u8> = self.buffer.drain(..5 + len).skip(5).collect();
                    if flags & FLAG_COMPRESSED != 0 {
                        return Err(RpcError::new("unimplemented", "compressed messages are not supported"));
                    }
                    if flags & FLAG_END != 0 {
                        self.ended = true;
                        return Ok(None);
                    }
                    let value = serde_json::from_slice(&payload)
                        .map_err(|e| RpcError::invalid(format!("the message is not JSON: {e}")))?;
                    return Ok(Some(value));
                }
            }
            if self.ended {
                return Ok(None);
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buffer.extend_from_slice(&chunk),
                Some(Err(err)) => return Err(RpcError::new("canceled", format!("reading the request: {err}"))),
                None if self.buffer.is_empty() => return Ok(None),
                None => return Err(RpcError::invalid("the request ends inside a message")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn envelopes_are_read_across_any_cut() {
        let mut bytes = message(&json!({"start": {"process": {"pid": 7}}})).to_vec();
        bytes.extend_from_slice(&message(&json!({"keepalive": {}})));
        bytes.extend_from_slice(&end(None));
        for cut in [1, 3, 5, 9, bytes.len() - 1] {
            let (a, b) = bytes.split_at(cut);
            let chunks: Vec<Result<Bytes, std::io::Error>> = vec![Ok(a.to_vec().into()), Ok(b.to_vec().into())];
            let mut envelopes = Envelopes::new(Body::from_stream(futures_util::stream::iter(chunks)));
            assert_eq!(envelopes.next().await.unwrap().unwrap()["start"]["process"]["pid"], 7);
            assert_eq!(envelopes.next().await.unwrap().unwrap(), json!({"keepalive": {}}));
            assert!(envelopes.next().await.unwrap().is_none());
        }
        let truncated: Vec<Result<Bytes, std::io::Error>> = vec![Ok(bytes[..7].to_vec().into())];
        let mut envelopes = Envelopes::new(Body::from_stream(futures_util::stream::iter(truncated)));
        assert_eq!(envelopes.next().await.unwrap_err().code, "invalid_argument");
    }

    #[test]
    fn the_end_carries_the_error() {
        let error = RpcError::not_found("no process 7");
        let frame = end(Some(&error));
        assert_eq!(frame[0], FLAG_END);
        let body: Value = serde_json::from_slice(&frame[5..]).unwrap();
        assert_eq!(body["error"]["code"], "not_found");
        assert_eq!(error.status(), StatusCode::NOT_FOUND);
    }
}
