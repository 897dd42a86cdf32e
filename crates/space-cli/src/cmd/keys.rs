//! `space keys` (tenants' API keys, on the server's own state) and
//! `space secret` (a tenant's secrets, through the API).

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::print_json;
use crate::cli::{KeysCommand, SecretCommand};

pub(crate) fn keys(command: KeysCommand) -> Result<()> {
    use space_server::store::{Quotas, Store};
    let open = |dir: &Path, database: Option<String>| -> Result<Store> {
        if let Some(url) = database {
            return Ok(Store::connect(&url)?);
        }
        let data = space_host::datadir::DataDir::open(dir)?;
        Ok(Store::open(&data.db_path())?)
    };
    match command {
        KeysCommand::Create {
            data_dir,
            database,
            tenant,
            max_sandboxes,
            max_vcpus,
            max_memory_mib,
            max_disk_mib,
            egress_ceiling,
            default_allow,
            e2b,
        } => {
            if !space_server::tenants::valid_tenant(&tenant) || tenant == space_server::store::OPERATOR_TENANT {
                bail!(
                    "tenant names are 1-63 lowercase letters, digits, '-' or '_' (and not {:?})",
                    space_server::store::OPERATOR_TENANT
                );
            }
            let store = open(&data_dir, database)?;
            space_egress::policy::Ceiling::parse(&egress_ceiling)
                .map_err(|e| anyhow::anyhow!("--egress-ceiling: {e}"))?;
            let network = (!default_allow.is_empty()).then(|| space_api::Network {
                egress: space_api::Egress::Allowlist,
                allow: default_allow,
                ..Default::default()
            });
            if let Some(network) = &network {
                space_server::egress::policy_of(network).map_err(|e| anyhow::anyhow!("--default-allow-host: {e}"))?;
            }
            let egress_ceiling = (!egress_ceiling.is_empty()).then_some(egress_ceiling);
            let quotas = Quotas { max_sandboxes, max_vcpus, max_memory_mib, max_disk_mib, network, egress_ceiling };
            let given = (quotas != Quotas::default()).then_some(&quotas);
            let (info, key) = space_server::tenants::create_key(&store, &tenant, given)?;
            eprintln!("key {} for tenant {tenant}; it is shown once, keep it now:", info.id);
            match e2b {
                true => println!("{}", space_api::e2b::e2b_key(&key)),
                false => println!("{key}"),
            }
        }
        KeysCommand::E2b => {
            let mut key = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut key).context("reading a key")?;
            let key = key.trim();
            if !key.starts_with("space_") {
                bail!("give a SPACE key (space_…) on standard input");
            }
            println!("{}", space_api::e2b::e2b_key(key));
        }
        KeysCommand::Ls { data_dir, database } => {
            println!("{:<26} {:<20} {:<26} REVOKED", "ID", "TENANT", "CREATED");
            for key in open(&data_dir, database)?.tenancy().keys()? {
                println!(
                    "{:<26} {:<20} {:<26} {}",
                    key.id,
                    key.tenant,
                    key.created_at,
                    key.revoked_at.map_or_else(|| "-".to_string(), |at| at.to_string())
                );
            }
        }
        KeysCommand::Revoke { id, data_dir, database } => {
            if !open(&data_dir, database)?.tenancy().revoke_key(&id, space_server::ids::now())? {
                bail!("no key {id:?}");
            }
            eprintln!("revoked {id}");
        }
    }
    Ok(())
}

pub(crate) fn secret(command: SecretCommand) -> Result<()> {
    match command {
        SecretCommand::Set { name, hosts, client } => {
            let mut value = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut value).context("reading the value from stdin")?;
            // A value piped in with `echo` ends with a newline that is not its.
            let value = value.strip_suffix('\n').map(|v| v.strip_suffix('\r').unwrap_or(v)).unwrap_or(&value);
            let body = serde_json::json!({"value": value, "hosts": hosts});
            print_json(&client.client()?.put(&format!("/v1/secrets/{name}"), &body)?);
        }
        SecretCommand::Ls { client } => {
            let list = client.client()?.get("/v1/secrets")?;
            println!("{:<24} {:<24} HOSTS", "NAME", "UPDATED");
            for secret in list["secrets"].as_array().into_iter().flatten() {
                let hosts: Vec<&str> =
                    secret["hosts"].as_array().into_iter().flatten().filter_map(|h| h.as_str()).collect();
                println!(
                    "{:<24} {:<24} {}",
                    secret["name"].as_str().unwrap_or(""),
                    secret["updated_at"].as_str().unwrap_or(""),
                    hosts.join(",")
                );
            }
        }
        SecretCommand::Rm { name, client } => client.client()?.delete_empty(&format!("/v1/secrets/{name}"))?,
    }
    Ok(())
}
