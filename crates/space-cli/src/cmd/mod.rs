//! The client commands: each talks to a server over its API.

mod code;
mod copy;
mod doctor;
mod keys;
mod sandbox;
pub(crate) mod template;
mod volume;

pub(crate) use self::code::{exec, run_code};
pub(crate) use self::copy::copy;
pub(crate) use self::doctor::{doctor, CONFINED_RECORD};
pub(crate) use self::keys::{keys, secret};
pub(crate) use self::sandbox::{describe_event, sandbox};
pub(crate) use self::template::template;
pub(crate) use self::volume::volume;

pub(crate) fn print_json(value: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
}

pub(crate) fn signal_number(name: &str) -> i32 {
    format!("SIG{name}").parse::<nix::sys::signal::Signal>().map(|s| s as i32).unwrap_or(0)
}
