//! Extractors whose every refusal is a 4xx in SPACE's error shape, never
//! axum's plain-text rejection.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use space_api::ErrorCode;

use crate::error::HttpError;

/// Largest JSON request body.
pub const MAX_JSON_BODY: usize = 1 << 20;

/// A JSON body whose every parse failure is a 4xx in our error shape.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = HttpError;

    async fn from_request(request: Request, state: &S) -> Result<Self, HttpError> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(ApiJson(value)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

/// Why a JSON body was refused, as the code a client can act on.
pub fn json_rejection(rejection: JsonRejection) -> HttpError {
    match rejection {
        JsonRejection::JsonDataError(err) => {
            HttpError::bad_request(format!("invalid request body: {}", err.body_text()))
                .with_details(serde_json::json!({"reason": "schema"}))
        }
        JsonRejection::JsonSyntaxError(err) => {
            HttpError::new(ErrorCode::MalformedJson, format!("the body is not valid JSON: {}", err.body_text()))
        }
        JsonRejection::MissingJsonContentType(_) => HttpError::new(
            ErrorCode::UnsupportedMediaType,
            "send the body as JSON with `Content-Type: application/json`",
        ),
        JsonRejection::BytesRejection(err) if err.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            HttpError::new(ErrorCode::TooLarge, format!("the request body exceeds {MAX_JSON_BODY} bytes"))
        }
        other => HttpError::bad_request(other.body_text()),
    }
}

/// Query parameters whose parse failures are 400s in our error shape.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, HttpError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(ApiQuery(value)),
            Err(rejection) => Err(query_rejection(rejection)),
        }
    }
}

fn query_rejection(rejection: QueryRejection) -> HttpError {
    HttpError::bad_request(format!("invalid query string: {}", rejection.body_text()))
}

/// A route that takes no query: any parameter would be ignored, so it is
/// refused (400).
pub struct NoQuery;

impl<S: Send + Sync> FromRequestParts<S> for NoQuery {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, HttpError> {
        match parts.uri.query() {
            None | Some("") => Ok(NoQuery),
            Some(_) => Err(HttpError::bad_request("this route takes no query parameters")),
        }
    }
}

/// A route that takes no body: one would be ignored, so it is refused
/// (400). Empty, or an empty JSON object (what clients send a POST without
/// arguments), is none. Take it last: it reads the body.
pub struct NoBody;

impl<S: Send + Sync> FromRequest<S> for NoBody {
    type Rejection = HttpError;

    async fn from_request(request: Request, _: &S) -> Result<Self, HttpError> {
        let refused = || HttpError::bad_request("this route takes no body");
        let bytes = axum::body::to_bytes(request.into_body(), 1024).await.map_err(|_| refused())?;
        match bytes.trim_ascii() {
            b"" | b"{}" => Ok(NoBody),
            _ => Err(refused()),
        }
    }
}
