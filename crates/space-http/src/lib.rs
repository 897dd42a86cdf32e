//! The parts of SPACE's HTTP edge that know no runtime: how an error is
//! answered (`HttpError`, where a code becomes its status), the body and
//! query extractors that answer in that shape, the API key's headers, the
//! server loop (TLS, timeouts, graceful drain), the port proxy's header
//! rules and its splice of an answer or an upgrade, streamed answers, the
//! event log's stream (`GET /v1/events` over a store), how the members of a
//! cluster reach each other (`Links`), and the web console's embedded files.
//!
//! It must not link the node runtime (`space-node`): the server's handlers,
//! the E2B adapter and a cluster's control plane build on it, each with
//! its own state.

pub mod api_error;
pub mod auth;
// Static files by name, no resource of a tenant.
#[allow(clippy::disallowed_types)]
pub mod console;
pub mod error;
pub mod events;
pub mod extract;
pub mod links;
pub mod preview;
pub mod proxy;
pub mod server;
pub mod stream;

pub use api_error::ApiError;
pub use error::HttpError;
