//! `space doctor`: what this host can run, and why not.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::cli::EngineArgs;

mod processes;

pub(crate) use self::processes::CONFINED_RECORD;

/// `space doctor`: each engine, available or not and why, what to do, the
/// data dir's state, and the privileges of SPACE's running processes.
/// Exits 1 when no engine can run.
pub(crate) fn doctor(data_dir: &Path, engine: &EngineArgs) -> Result<i32> {
    let code = engines(data_dir, engine)?;
    processes::report();
    Ok(code)
}

fn engines(data_dir: &Path, engine: &EngineArgs) -> Result<i32> {
    let ok = |yes: bool| if yes { "yes" } else { "no " };
    let data = match space_host::datadir::DataDir::open(data_dir) {
        Ok(data) => data,
        Err(err) => {
            println!("data dir  no  {err}");
            println!("          run `space setup --data-dir {}` first", data_dir.display());
            return Ok(1);
        }
    };
    let quotas = space_host::btrfs::quota_mode(data.root()).map(|m| format!("{m:?}")).unwrap_or_else(|e| e.to_string());
    println!("data dir  yes {} on btrfs, quotas: {quotas}", data.root().display());
    // A missing agent is one of the things the report names.
    let agent = engine.agent_bin().unwrap_or_else(|_| PathBuf::from("space-agent (not found)"));
    let config = engine.config_with_agent(data_dir, agent)?;
    let report = space_server::engine_report(&config, &data);
    for availability in &report {
        println!("{:<9} {} {}", availability.name, ok(availability.available), availability.detail);
        if !availability.available && availability.name == "firecracker" {
            println!(
                "          Firecracker needs vmx/svm and a firecracker binary (README: Firecracker on a KVM host)"
            );
        }
    }
    if let Some(binary) = space_engine::firecracker::find_firecracker(config.firecracker_bin.as_deref()) {
        let (jailed, detail) = space_engine::firecracker::jail_report(&binary);
        println!("jailer    {} {detail}", ok(jailed));
    }
    let kvm = space_server::api::kvm_status();
    println!("kvm       {} {}", ok(kvm.present), kvm.detail);
    let picked =
        report.iter().find(|a| a.name == "firecracker" && a.available).or_else(|| report.iter().find(|a| a.available));
    match picked {
        Some(engine) => {
            println!("engine    {} (what `space serve --engine auto` uses)", engine.name);
            Ok(0)
        }
        None => {
            println!("engine    none can run here");
            Ok(1)
        }
    }
}
