//! Egress for sandboxes: a sandbox has no network device; its programs
//! reach the outside through a proxy (the agent relays each connection to
//! `127.0.0.1:3128` in the sandbox over its own channel to the host), and
//! this gateway, on the host, makes every decision with the sandbox's
//! [`policy::Policy`]: names are judged before they are looked up, the
//! addresses they resolve to are judged again, and every connection is an
//! audit [`gateway::Event`].

pub mod ca;
pub mod framing;
pub mod gateway;
pub mod inspect;
pub mod policy;
pub mod tls;
