//! `space`: one binary that prepares the host, serves the API, and is the
//! command-line client. It parses arguments and wires parts together; the
//! logic lives in the library crates.

mod attach;
mod bench;
mod client;
mod cluster_bench;
mod density;
mod forward;
mod mcp;
mod restart_bench;
mod setup;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

const DEFAULT_DATA_DIR: &str = "/var/lib/space";
const DEFAULT_URL: &str = "http://127.0.0.1:7070";

#[derive(Parser)]
#[command(name = "space", version, about = "SPACE: isolated sandboxes for agent-written code")]
struct Cli {
    #[command(subcommand)]
    command: Top,
}

#[derive(Subcommand)]
enum Top {
    /// Prepare this host: packages, a btrfs data dir, the `base` template.
    Setup(setup::SetupArgs),
    /// Run the API server (with --cluster: a cluster's control plane).
    Serve(ServeArgs),
    /// Run a node of a cluster: this host's sandboxes, answering only the
    /// control plane (decision 009).
    Node(NodeArgs),
    /// Create, list, inspect and delete sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Run a command in a sandbox, streaming its output; exits with its code.
    Exec(ExecArgs),
    /// Run code in an interpreter kept alive in a sandbox (a code context):
    /// its output as it comes, then its value; exits 1 if it raised.
    Run(RunArgs),
    /// Inspect operations.
    #[command(subcommand)]
    Op(OpCommand),
    /// Build, list, inspect and delete templates.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Copy a file or directory into or out of a sandbox: `LOCAL SBX:/path` or `SBX:/path LOCAL`.
    Cp {
        from: String,
        to: String,
        /// Permission bits (octal) for a file copied in; default: the local file's.
        #[arg(long)]
        mode: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Measure create and exec latency against the raw runsc floor.
    Bench(bench::BenchArgs),
    /// Serve the Model Context Protocol on stdin/stdout: tools that create
    /// sandboxes, run commands and move files (uses SPACE_URL, SPACE_API_KEY).
    Mcp {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Tell which engines this host can run, and why not.
    Doctor {
        #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Make, list and revoke tenants' API keys (works beside a running server).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Show what happened to your sandboxes, operations and commands
    /// (`--follow`: as it happens, resuming by event id if the stream breaks).
    Events {
        /// Keep following new events.
        #[arg(long, short)]
        follow: bool,
        /// Start at this event id (0: the oldest kept).
        #[arg(long)]
        from: Option<u64>,
        /// Only these types, comma-separated (`sandbox`, `operation`,
        /// `command`, or full names such as `command.exited`).
        #[arg(long)]
        types: Option<String>,
        /// Only this sandbox's events.
        #[arg(long)]
        sandbox: Option<String>,
        /// Print each event as one JSON line.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Carry connections to a local port to a port inside a sandbox (a dev
    /// server, a database): `space port-forward SBX 8080:3000`. Prints the
    /// local address (LOCAL 0: any free port) and runs until interrupted.
    PortForward {
        sandbox: String,
        /// LOCAL:REMOTE, or one port for both.
        ports: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Write, list and delete your tenant's secrets (values are never shown).
    #[command(subcommand)]
    Secret(SecretCommand),
}

#[derive(Subcommand)]
enum SecretCommand {
    /// Write a secret: its value is read from stdin (never from the command
    /// line, where other users and shell history could see it).
    Set {
        name: String,
        /// A host it may be sent to: `name` or `*.suffix` (repeatable).
        #[arg(long = "host", value_name = "HOST", required = true)]
        hosts: Vec<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List secrets: names and hosts.
    Ls {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a secret (sandboxes bound to it get `secret_unavailable`).
    Rm {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Make a key for a tenant and print it once; only its hash is kept.
    Create {
        #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// The server's PostgreSQL database, if it keeps state there.
        #[arg(long, env = "SPACE_DATABASE", hide_env_values = true)]
        database: Option<String>,
        #[arg(long)]
        tenant: String,
        /// The tenant's quotas (kept for the tenant; 429 past them).
        #[arg(long)]
        max_sandboxes: Option<u32>,
        #[arg(long)]
        max_vcpus: Option<u32>,
        #[arg(long)]
        max_memory_mib: Option<u64>,
        /// Host disk (MiB) for the tenant's roots, output, snapshots,
        /// templates and uploads together.
        #[arg(long)]
        max_disk_mib: Option<u64>,
        /// What the tenant's sandboxes may ever reach (an egress rule; `*`
        /// for any public host; repeatable). Without it: no ceiling.
        #[arg(long = "egress-ceiling", value_name = "RULE")]
        egress_ceiling: Vec<String>,
        /// An allowed host for the tenant's sandboxes whose create and
        /// template name no network (repeatable).
        #[arg(long = "default-allow-host", value_name = "RULE")]
        default_allow: Vec<String>,
    },
    /// List keys (ids, tenants, dates; never the keys).
    Ls {
        #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// The server's PostgreSQL database, if it keeps state there.
        #[arg(long, env = "SPACE_DATABASE", hide_env_values = true)]
        database: Option<String>,
    },
    /// Revoke a key by its id; requests with it get 401 at once.
    Revoke {
        id: String,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// The server's PostgreSQL database, if it keeps state there.
        #[arg(long, env = "SPACE_DATABASE", hide_env_values = true)]
        database: Option<String>,
    },
}

/// `space doctor`: each engine, available or not and why, what to do, and
/// the data dir's state. Exits 1 when no engine can run.
fn doctor(data_dir: &Path, engine: &EngineArgs) -> Result<i32> {
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

fn keys(command: KeysCommand) -> Result<()> {
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
            println!("{key}");
        }
        KeysCommand::Ls { data_dir, database } => {
            println!("{:<26} {:<20} {:<26} REVOKED", "ID", "TENANT", "CREATED");
            for key in open(&data_dir, database)?.keys()? {
                println!(
                    "{:<26} {:<20} {:<26} {}",
                    key.id,
                    key.tenant,
                    key.created_at,
                    key.revoked_at.as_deref().unwrap_or("-")
                );
            }
        }
        KeysCommand::Revoke { id, data_dir, database } => {
            if !open(&data_dir, database)?.revoke_key(&id, &space_server::ids::now())? {
                bail!("no key {id:?}");
            }
            eprintln!("revoked {id}");
        }
    }
    Ok(())
}

/// Where the API is and how to authenticate.
#[derive(Args, Clone)]
pub struct ClientArgs {
    /// The server's URL.
    #[arg(long, env = "SPACE_URL", default_value = DEFAULT_URL, global = true)]
    url: String,
    /// The API key (default: the dev key in --data-dir, if readable).
    #[arg(long, env = "SPACE_API_KEY", hide_env_values = true, global = true)]
    api_key: Option<String>,
    /// Data dir whose dev-api-key to use when no key is given.
    #[arg(long = "key-data-dir", env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR, global = true)]
    key_data_dir: PathBuf,
}

impl ClientArgs {
    fn client(&self) -> Result<client::Client> {
        let key = match &self.api_key {
            Some(key) => key.clone(),
            None => std::fs::read_to_string(self.key_data_dir.join("dev-api-key"))
                .map(|k| k.trim().to_string())
                .with_context(|| {
                    format!(
                        "no API key: set SPACE_API_KEY, or run a dev server (`space serve --dev`) whose key is in {}",
                        self.key_data_dir.display()
                    )
                })?,
        };
        Ok(client::Client::new(&self.url, &key))
    }
}

#[derive(Args)]
struct NodeArgs {
    #[command(flatten)]
    serve: ServeArgs,
    /// The control plane's URL (`http://host:port`), or several replicas'
    /// (comma-separated; one that does not answer is passed over).
    #[arg(long)]
    control_plane: String,
    /// This node's name in the cluster (default: the host name).
    #[arg(long)]
    node_id: Option<String>,
    /// Where the control plane reaches this node (default: the address it
    /// listens on).
    #[arg(long)]
    advertise: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Development mode: loopback only, with a generated key in DATA_DIR/dev-api-key.
    #[arg(long)]
    dev: bool,
    /// File holding the operator's API key (required without --dev);
    /// tenants' keys come from `space keys create`.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve plain HTTP on a non-loopback address (keys then cross the
    /// network in clear text; only behind a TLS-terminating proxy).
    #[arg(long)]
    insecure_http: bool,
    /// Serve `GET /metrics` without a key (for a Prometheus scraper on a
    /// trusted network); by default it needs the server's own key, as it
    /// shows figures of every tenant together.
    #[arg(long)]
    metrics_without_key: bool,
    /// `text` or `json` (one object per line, with request ids).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Keep state in this PostgreSQL database (`postgres://user@host/db`)
    /// instead of the data dir's SQLite file (made if missing).
    #[arg(long, env = "SPACE_DATABASE", hide_env_values = true)]
    database: Option<String>,
    /// Be a cluster's control plane (needs --database and
    /// --node-token-file): no sandboxes here, requests go to the nodes.
    #[arg(long, requires = "database", requires = "node_token_file")]
    cluster: bool,
    /// The cluster's node token (the control plane and its nodes share it).
    #[arg(long)]
    node_token_file: Option<PathBuf>,
    /// A control plane's key that seals tenants' secrets in PostgreSQL: 32
    /// bytes, or 64 hex digits (`openssl rand -hex 32`), the same file on
    /// every replica. Without it the control plane keeps no secrets.
    #[arg(long, requires = "cluster")]
    secrets_key_file: Option<PathBuf>,
    /// The CA (PEM) of a cluster's own links: with --cluster-cert and
    /// --cluster-key, control plane and nodes speak mutual TLS to each
    /// other, each side asking the other for a certificate of this CA.
    #[arg(long, requires_all = ["cluster_cert", "cluster_key"])]
    cluster_ca: Option<PathBuf>,
    /// This member's certificate on the cluster's links (PEM, signed by
    /// --cluster-ca); a node serves its API with it.
    #[arg(long, requires = "cluster_ca")]
    cluster_cert: Option<PathBuf>,
    /// The key of --cluster-cert (PEM).
    #[arg(long, requires = "cluster_ca")]
    cluster_key: Option<PathBuf>,
    /// A control plane: also take nodes' heartbeats here, over the
    /// cluster's mutual TLS (give nodes this address as --control-plane
    /// https://…).
    #[arg(long, requires = "cluster_ca", requires = "cluster")]
    cluster_listen: Option<SocketAddr>,
    #[command(flatten)]
    engine: EngineArgs,
}

impl ServeArgs {
    /// The cluster's TLS, if asked for.
    fn cluster_tls(&self) -> Result<Option<space_server::http::ClusterTls>> {
        match (&self.cluster_ca, &self.cluster_cert, &self.cluster_key) {
            (Some(ca), Some(cert), Some(key)) => Ok(Some(space_server::http::cluster_tls(ca, cert, key)?)),
            _ => Ok(None),
        }
    }
}

#[derive(Args, Clone)]
pub struct EngineArgs {
    /// The statically linked guest agent.
    #[arg(long, env = "SPACE_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
    /// The runsc binary.
    #[arg(long, env = "SPACE_RUNSC", default_value = "runsc")]
    runsc: PathBuf,
    /// Warm (pre-started, paused) sandboxes kept per template for fast create.
    #[arg(long, env = "SPACE_WARM_POOL", default_value_t = 2)]
    warm_pool: u32,
    /// Hot (running, agent connected) sandboxes kept per template in front
    /// of the warm ones: a create of the default shape is then an identity
    /// hand-off (each dozes while it waits: ≈ 0.3 % of a core under gVisor).
    #[arg(long, env = "SPACE_HOT_POOL", default_value_t = 1)]
    hot_pool: u32,
    /// Memory (MiB) the host may promise to sandboxes; default: host memory less 1 GiB.
    #[arg(long, env = "SPACE_CAPACITY_MIB")]
    capacity_mib: Option<u64>,
    /// Also build ext4 root drives (Firecracker's) for templates; default:
    /// when the host has hardware virtualization.
    #[arg(long, env = "SPACE_EXT4_IMAGES")]
    ext4_images: Option<bool>,
    /// The engine: auto (Firecracker where it can run, else gVisor),
    /// gvisor, or firecracker.
    #[arg(long, env = "SPACE_ENGINE", default_value = "auto")]
    engine: space_server::EngineChoice,
    /// The firecracker binary (its jailer is looked for beside it).
    #[arg(long, env = "FIRECRACKER_BIN")]
    firecracker_bin: Option<PathBuf>,
    /// Seconds a running sandbox may sit idle (no command running, no
    /// request) before the server pauses it; its next command or file
    /// request resumes it first. 0: never.
    #[arg(long, env = "SPACE_AUTO_PAUSE_S", default_value_t = space_server::DEFAULT_AUTO_PAUSE_S)]
    auto_pause_s: u64,
    /// Output (MiB) kept per command; the rest is counted, not stored.
    #[arg(long, env = "SPACE_MAX_OUTPUT_MIB", default_value_t = space_server::platform::DEFAULT_MAX_OUTPUT_BYTES >> 20)]
    max_output_mib: u64,
    /// Output (MiB) kept per sandbox, all its commands together.
    #[arg(long, env = "SPACE_MAX_SANDBOX_OUTPUT_MIB",
        default_value_t = space_server::disk::DEFAULT_MAX_SANDBOX_OUTPUT_BYTES >> 20)]
    max_sandbox_output_mib: u64,
    /// Free space (MiB) of the data dir the host keeps: under it, creates,
    /// suspends, template builds and uploads get 507 and output is not kept.
    #[arg(long, env = "SPACE_DISK_RESERVE_MIB", default_value_t = space_server::disk::DEFAULT_DISK_RESERVE_MIB)]
    disk_reserve_mib: u64,
    /// A fixed answer for the egress gateway, NAME=IP or NAME=IP:PORT
    /// (repeatable; with a port, connections to NAME go to that port
    /// whatever port was asked): when given, names resolve only through
    /// these (an internal mirror, a test).
    #[arg(long = "egress-host", value_name = "NAME=IP[:PORT]")]
    egress_hosts: Vec<String>,
    /// PEM file of CA certificates the gateway also trusts for upstreams it
    /// terminates TLS to (repeatable; besides the system's roots).
    #[arg(long = "egress-trust", value_name = "FILE")]
    egress_trust: Vec<PathBuf>,
    /// Internal addresses (IP or CIDR, repeatable) sandboxes may reach
    /// through the gateway anyway; everything internal is refused otherwise.
    #[arg(long = "egress-allow-internal", value_name = "CIDR")]
    egress_allow_internal: Vec<String>,
    /// Connections each sandbox may have open through the gateway at once.
    #[arg(long, default_value_t = space_egress::gateway::MAX_CONNECTIONS)]
    egress_max_connections: usize,
    /// New connections each sandbox may open per second (429 past it).
    #[arg(long, default_value_t = space_egress::gateway::NEW_PER_SECOND)]
    egress_new_per_second: u32,
    /// MiB per second each sandbox's egress may move each way, all its
    /// connections together (0: unlimited).
    #[arg(long, default_value_t = 0)]
    egress_rate_mib: u64,
}

impl EngineArgs {
    /// The guest agent: `--agent-bin`, else a statically linked
    /// `space-agent` beside this binary, in the static build's target dir,
    /// or installed. It runs in roots and initramfs images that have no
    /// libc of its kind, so a dynamically linked one (such as the one
    /// `cargo build` leaves beside a debug `space`) is refused or passed over.
    pub fn agent_bin(&self) -> Result<PathBuf> {
        let is_static = |path: &Path| space_host::is_static_elf(path).unwrap_or(false);
        if let Some(path) = &self.agent_bin {
            // Absolute: the engine hands it to runsc, which runs elsewhere.
            let path = std::fs::canonicalize(path).with_context(|| format!("the agent {}", path.display()))?;
            anyhow::ensure!(
                is_static(&path),
                "the agent {} is not a statically linked executable (scripts/run.sh and scripts/test.sh build one)",
                path.display()
            );
            return Ok(path);
        }
        let exe = std::env::current_exe().context("locating the space binary")?;
        let dir = exe.parent().unwrap_or(Path::new("/"));
        let candidates = [
            dir.join("space-agent"),
            dir.join("../x86_64-unknown-linux-gnu/release/space-agent"),
            PathBuf::from("/usr/local/lib/space/space-agent"),
        ];
        candidates.iter().find(|p| p.is_file() && is_static(p)).cloned().with_context(|| {
            "cannot find the static space-agent: scripts/run.sh and scripts/test.sh build one, or pass --agent-bin"
                .to_string()
        })
    }

    pub fn platform_config(&self, data_dir: &Path) -> Result<space_server::PlatformConfig> {
        self.config_with_agent(data_dir, self.agent_bin()?)
    }

    fn config_with_agent(&self, data_dir: &Path, agent_bin: PathBuf) -> Result<space_server::PlatformConfig> {
        let mut egress = space_server::egress::EgressSettings::parse(&self.egress_hosts, &self.egress_allow_internal)
            .map_err(|e| anyhow::anyhow!("egress settings: {e}"))?;
        egress.trust = self.egress_trust.clone();
        egress.max_connections = Some(self.egress_max_connections);
        egress.new_per_second = Some(self.egress_new_per_second);
        egress.rate_mib = Some(self.egress_rate_mib);
        Ok(space_server::PlatformConfig {
            data_dir: data_dir.to_path_buf(),
            runsc: self.runsc.clone(),
            agent_bin,
            warm_pool: self.warm_pool,
            hot_pool: self.hot_pool,
            capacity_mib: self.capacity_mib,
            ext4_images: self.ext4_images,
            engine: self.engine,
            firecracker_bin: self.firecracker_bin.clone(),
            auto_pause_s: self.auto_pause_s,
            max_output_mib: self.max_output_mib,
            max_sandbox_output_mib: self.max_sandbox_output_mib,
            disk_reserve_mib: self.disk_reserve_mib,
            egress,
            database: None,
        })
    }
}

fn secret(command: SecretCommand) -> Result<()> {
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

/// A sandbox's egress policy on the command line.
#[derive(Args, Clone)]
pub struct NetworkArgs {
    /// none, allowlist or public (default: allowlist when --allow-host is
    /// given, else none).
    #[arg(long)]
    egress: Option<String>,
    /// An allowed host: `name`, `*.suffix`, IP or CIDR, with optional
    /// `:port[,port]` (repeatable).
    #[arg(long = "allow-host", value_name = "RULE")]
    allow: Vec<String>,
    /// A denied host, in the same forms (repeatable).
    #[arg(long = "deny-host", value_name = "RULE")]
    deny: Vec<String>,
    /// Bind a secret: the variable ENV holds a placeholder, and the gateway
    /// adds the secret NAME on HTTPS requests to its hosts (repeatable).
    #[arg(long = "secret", value_name = "ENV=NAME", value_parser = parse_pair)]
    secrets: Vec<(String, String)>,
}

impl NetworkArgs {
    /// The policy as the API takes it; `None` when nothing was given.
    fn to_json(&self) -> Option<serde_json::Value> {
        let egress = match &self.egress {
            Some(mode) => mode.clone(),
            None if !self.allow.is_empty() || !self.secrets.is_empty() => "allowlist".into(),
            None if !self.deny.is_empty() => "public".into(),
            None => return None,
        };
        let secrets: serde_json::Map<String, serde_json::Value> =
            self.secrets.iter().map(|(env, name)| (env.clone(), serde_json::json!({"secret": name}))).collect();
        Some(serde_json::json!({"egress": egress, "allow": self.allow, "deny": self.deny, "secrets": secrets}))
    }
}

#[derive(Subcommand)]
enum SandboxCommand {
    /// Create a sandbox and wait until it runs.
    Create {
        #[arg(long, default_value = "base")]
        template: String,
        #[arg(long)]
        vcpus: Option<u32>,
        #[arg(long)]
        memory_mib: Option<u32>,
        #[arg(long)]
        disk_mib: Option<u32>,
        /// Environment for every command, KEY=VALUE (repeatable).
        #[arg(long = "env", value_parser = parse_pair)]
        env: Vec<(String, String)>,
        /// Label, key=value (repeatable).
        #[arg(long = "label", value_parser = parse_pair)]
        labels: Vec<(String, String)>,
        #[command(flatten)]
        network: NetworkArgs,
        /// Return once accepted, without waiting for the sandbox to run.
        #[arg(long)]
        no_wait: bool,
        /// Print only the sandbox id.
        #[arg(long, short)]
        quiet: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List sandboxes.
    Ls {
        #[arg(long)]
        state: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show one sandbox as JSON.
    Get {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Replace a sandbox's egress policy while it runs (open connections
    /// it no longer allows are cut).
    Network {
        id: String,
        #[command(flatten)]
        network: NetworkArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show the connections a sandbox made through the egress gateway.
    Egress {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a sandbox and wait until it is gone.
    Rm {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Freeze a sandbox in memory and wait until it is paused.
    Pause {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Snapshot a sandbox to disk (the engine process exits) and wait.
    Suspend {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Resume a paused or suspended sandbox and wait until it runs.
    Resume {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Fork a running sandbox (memory, processes, disk at one instant) and
    /// wait until the forks run; prints their ids.
    Fork {
        id: String,
        /// How many forks (1 to 16).
        #[arg(short = 'n', long, default_value_t = 1)]
        count: u32,
        /// Label of the forks, key=value (repeatable; over the source's).
        #[arg(long = "label", value_parser = parse_pair)]
        labels: Vec<(String, String)>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Save a checkpoint of a running sandbox (it runs on) and wait.
    Checkpoint {
        id: String,
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List a sandbox's checkpoints.
    Checkpoints {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Roll a sandbox back to one of its checkpoints and wait until it runs.
    Restore {
        id: String,
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete one of a sandbox's checkpoints.
    RmCheckpoint {
        id: String,
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Args)]
struct RunArgs {
    sandbox: String,
    /// Python (a Jupyter kernel; needs the code-interpreter template).
    #[arg(long)]
    python: bool,
    /// The code (`-` reads it from stdin).
    #[arg(short = 'c', long = "code")]
    code: String,
    /// A context to run in (its state carries over); without it a new one
    /// is made for this run and stopped after.
    #[arg(long)]
    context: Option<String>,
    /// Interrupt the run after this many seconds.
    #[arg(long)]
    timeout: Option<u64>,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Args)]
struct ExecArgs {
    sandbox: String,
    /// Working directory inside the sandbox.
    #[arg(long)]
    cwd: Option<String>,
    /// Environment, KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e', value_parser = parse_pair)]
    env: Vec<(String, String)>,
    /// Kill the command after this many seconds.
    #[arg(long)]
    timeout: Option<u64>,
    /// Keep stdin open and send ours (over the attach WebSocket).
    #[arg(short = 'i', long)]
    interactive: bool,
    /// Run on a pseudo-terminal; our terminal goes into raw mode.
    #[arg(short = 't', long)]
    tty: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    argv: Vec<String>,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// Build a template from Debian packages, showing progress.
    Build {
        #[arg(long)]
        name: String,
        /// Packages, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        debian_packages: Vec<String>,
        #[arg(long, default_value = "bookworm")]
        suite: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make a template of an OCI image archive (`docker save` output or an
    /// OCI image layout in a tar, optionally gzip-compressed).
    ImportOci {
        file: PathBuf,
        #[arg(long)]
        name: String,
        /// Default working directory (over the image's WorkingDir).
        #[arg(long)]
        workdir: Option<String>,
        /// Default user (over the image's User).
        #[arg(long)]
        user: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make a template of a directory on this host (no server needed).
    ImportDir {
        dir: PathBuf,
        #[arg(long)]
        name: String,
        #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Make a snapshot template of a running sandbox (or of one of its
    /// checkpoints): its sandboxes start from that state instead of booting.
    FromSandbox {
        /// The new template's name.
        name: String,
        /// The sandbox.
        sandbox: String,
        /// One of the sandbox's checkpoints, instead of its state now.
        #[arg(long)]
        checkpoint: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List templates.
    Ls {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show one template as JSON.
    Get {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete every version of a template (refused while sandboxes use it).
    Rm {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
enum OpCommand {
    /// Show an operation, optionally waiting for it to finish.
    Get {
        id: String,
        /// Seconds to wait for a terminal state (max 60).
        #[arg(long)]
        wait: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Wait until an operation ends; exit 0 only if it succeeded.
    Wait {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

fn parse_pair(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {text:?}"))
}

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("space: {err:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Top::Setup(args) => setup::run(args).map(|()| 0),
        Top::Serve(args) if args.cluster => control_plane(args).map(|()| 0),
        Top::Serve(args) => serve(args, None).map(|()| 0),
        Top::Node(node) => {
            let NodeArgs { serve: args, control_plane, node_id, advertise } = node;
            let id = match node_id {
                Some(id) => id,
                None => nix::unistd::gethostname()?.to_string_lossy().into_owned(),
            };
            serve(args, Some(NodeRole { control_plane, id, advertise })).map(|()| 0)
        }
        Top::Sandbox(command) => sandbox(command).map(|()| 0),
        Top::Exec(args) => exec(args),
        Top::Run(args) => run_code(args),
        Top::Op(OpCommand::Get { id, wait, client }) => {
            let path = match wait {
                Some(s) => format!("/v1/operations/{id}?wait={s}"),
                None => format!("/v1/operations/{id}"),
            };
            print_json(&client.client()?.get(&path)?);
            Ok(0)
        }
        Top::Op(OpCommand::Wait { id, client }) => {
            let operation = client.client()?.wait_operation(&id)?;
            print_json(&operation);
            Ok(if operation["state"] == "succeeded" { 0 } else { 1 })
        }
        Top::Template(command) => template(command).map(|()| 0),
        Top::Secret(command) => secret(command).map(|()| 0),
        Top::Cp { from, to, mode, client } => copy(&client.client()?, &from, &to, mode).map(|()| 0),
        Top::Bench(args) => bench::run(args).map(|()| 0),
        Top::Keys(command) => keys(command).map(|()| 0),
        Top::Events { follow, from, types, sandbox, json, client } => {
            let mut query = vec![];
            if let Some(types) = types {
                query.push(format!("types={}", client::encode(&types)));
            }
            if let Some(sandbox) = sandbox {
                query.push(format!("sandbox_id={}", client::encode(&sandbox)));
            }
            client.client()?.events(&query.join("&"), from, follow, |event| {
                match json {
                    true => println!("{}", serde_json::to_string(&event).unwrap_or_default()),
                    false => println!("{}", describe_event(&event)),
                }
                Ok(())
            })?;
            Ok(0)
        }
        Top::Mcp { client } => mcp::serve(&client.client()?).map(|()| 0),
        Top::PortForward { sandbox, ports, client } => {
            let (local, remote) = forward::parse_ports(&ports)?;
            forward::run(&client.client()?, &sandbox, local, remote).map(|()| 0)
        }
        Top::Doctor { data_dir, engine } => doctor(&data_dir, &engine),
    }
}

/// One line for a person: id, time, type, sandbox, and what changed.
fn describe_event(event: &space_api::Event) -> String {
    let what = if let Some(sandbox) = &event.sandbox {
        let mut text = sandbox.state.as_str().to_string();
        if let Some(reason) = &sandbox.failure_reason {
            text.push_str(&format!(" ({reason})"));
        }
        text
    } else if let Some(op) = &event.operation {
        let subject = op.template.as_deref().map(|t| format!(" template {t}")).unwrap_or_default();
        // The names the API uses.
        let name = |value: serde_json::Value| value.as_str().unwrap_or_default().to_string();
        let (kind, state) = (name(serde_json::json!(op.kind)), name(serde_json::json!(op.state)));
        let mut text = format!(
            "{} {kind}{subject} {state}: {}/{} {}",
            op.id, op.progress.done, op.progress.total, op.progress.step
        );
        if let Some(error) = &op.error {
            text.push_str(&format!(" ({})", error.message));
        }
        text
    } else if let Some(command) = &event.command {
        match &command.result {
            Some(result) => match (&result.exit_code, &result.signal) {
                (Some(code), _) => format!("{} exit {code} after {} ms", command.id, result.duration_ms),
                (None, Some(signal)) => format!("{} killed by {signal} after {} ms", command.id, result.duration_ms),
                (None, None) => {
                    format!("{} ended: {}", command.id, result.error.as_deref().unwrap_or("by the platform"))
                }
            },
            None => format!("{} {}", command.id, command.argv.join(" ")),
        }
    } else {
        "events before this one are no longer kept".to_string()
    };
    format!(
        "#{:<6} {} {:<18} {:<26} {what}",
        event.id,
        event.at,
        event.kind.as_str(),
        event.sandbox_id.as_deref().unwrap_or("-")
    )
}

fn print_json(value: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
}

/// How `space serve` writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Lines for people.
    Text,
    /// One JSON object per line, with the request's span (request id,
    /// route, tenant, sandbox or operation id) in each.
    Json,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).init(),
    }
}

/// What a node adds to `serve`.
struct NodeRole {
    control_plane: String,
    id: String,
    advertise: Option<String>,
}

fn read_secret_file(path: &Path, what: &str) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let text = text.trim().to_string();
    if text.len() < 16 {
        bail!("the {what} in {} is shorter than 16 characters", path.display());
    }
    Ok(text)
}

/// `space serve --cluster`: a control plane over PostgreSQL and its nodes.
fn control_plane(args: ServeArgs) -> Result<()> {
    init_logging(args.log_format);
    let url = args.database.as_deref().context("--cluster needs --database")?;
    let token =
        read_secret_file(args.node_token_file.as_deref().context("--cluster needs --node-token-file")?, "node token")?;
    let key = match &args.api_key_file {
        Some(path) => read_secret_file(path, "API key")?,
        None => bail!("a control plane needs --api-key-file"),
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(space_server::http::tls_config(cert, key)?),
        _ => None,
    };
    if tls.is_none() && !args.listen.ip().is_loopback() && !args.insecure_http {
        bail!(
            "{} is not a loopback address: serve it with --tls-cert and --tls-key, or say --insecure-http",
            args.listen
        );
    }
    let keyring = match &args.secrets_key_file {
        // Made here, each replica would seal with a key of its own.
        Some(path) if !path.exists() => {
            bail!("{} does not exist: make it once (openssl rand -hex 32) and give every replica it", path.display())
        }
        Some(path) => Some(
            space_server::secrets::Keyring::load_or_create(path)
                .with_context(|| format!("reading the secrets key {}", path.display()))?,
        ),
        None => None,
    };
    let cluster_tls = args.cluster_tls()?;
    let links = space_server::cluster::Links::new(cluster_tls.as_ref().map(|t| t.client.clone()));
    let store = space_server::store::Store::connect(url)?;
    let cp = std::sync::Arc::new(space_server::cluster::ControlPlane {
        store,
        api_key: key,
        node_token: token,
        keyring,
        links,
    });
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.spawn(space_server::cluster::replicate_templates(cp.clone()));
    runtime.spawn(space_server::cluster::follow_feeds(cp.clone()));
    runtime.spawn(space_server::cluster::watch_event_head(cp.clone()));
    runtime.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!("SPACE control plane listening on {scheme}://{}", listener.local_addr()?);
        if let (Some(address), Some(cluster_tls)) = (args.cluster_listen, &cluster_tls) {
            let internal =
                tokio::net::TcpListener::bind(address).await.with_context(|| format!("binding {address}"))?;
            tracing::info!("taking nodes' heartbeats on https://{}", internal.local_addr()?);
            let router = space_server::cluster::internal_router(cp.clone());
            tokio::spawn(space_server::http::serve_router(
                internal,
                router,
                Some(cluster_tls.server.clone()),
                std::future::pending(),
            ));
        }
        let shutdown = async move {
            term.recv().await;
        };
        space_server::http::serve_router(listener, space_server::cluster::router(cp), tls, shutdown).await?;
        Ok(())
    })
}

fn serve(args: ServeArgs, node: Option<NodeRole>) -> Result<()> {
    init_logging(args.log_format);
    if args.dev && !args.listen.ip().is_loopback() {
        bail!("--dev binds loopback only; {} is not a loopback address", args.listen);
    }
    // A node of a cluster with TLS serves the cluster's mutual TLS.
    let cluster_tls = args.cluster_tls()?;
    let tls = match (&args.tls_cert, &args.tls_key, &cluster_tls) {
        (Some(_), _, Some(_)) => bail!("a node serves with --cluster-cert; --tls-cert is for a server's clients"),
        (_, _, Some(cluster)) if node.is_some() => Some(cluster.server.clone()),
        (_, _, Some(_)) => bail!("--cluster-ca is for a cluster's members (space node, space serve --cluster)"),
        (Some(cert), Some(key), None) => Some(space_server::http::tls_config(cert, key)?),
        _ => None,
    };
    if tls.is_none() && !args.listen.ip().is_loopback() && !args.insecure_http {
        bail!(
            "{} is not a loopback address: serve it with --tls-cert and --tls-key, or say --insecure-http \
             (API keys would cross the network in clear text)",
            args.listen
        );
    }
    let mut config = args.engine.platform_config(&args.data_dir)?;
    config.database = args.database.clone();
    let platform = space_server::start_platform(&config)?;
    platform.metrics_without_key.store(args.metrics_without_key, std::sync::atomic::Ordering::Relaxed);
    let node_token = match (&node, &args.node_token_file) {
        (Some(_), Some(path)) => Some(read_secret_file(path, "node token")?),
        (Some(_), None) => bail!("a node needs --node-token-file"),
        (None, _) => None,
    };
    let key = if node.is_some() {
        String::new() // a node takes only the node token
    } else if args.dev {
        eprintln!(
            "WARNING: development mode: loopback only, one API key in {}. Do not expose this server.",
            platform.data.dev_key_path().display()
        );
        dev_key(&platform.data.dev_key_path())?
    } else {
        let path = args.api_key_file.as_ref().context("without --dev, --api-key-file is required")?;
        let key = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let key = key.trim().to_string();
        if key.len() < 16 {
            bail!("the API key in {} is shorter than 16 characters", path.display());
        }
        key
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        // Handlers go in before the address is announced, so a client that
        // saw it can always stop the server cleanly.
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        platform.start().await.map_err(|e| anyhow::anyhow!(e.message))?;
        let state = match (node, node_token) {
            (Some(node), Some(token)) => {
                let scheme = if cluster_tls.is_some() { "https" } else { "http" };
                let url = node.advertise.unwrap_or_else(|| format!("{scheme}://{}", args.listen));
                let url = match listener.local_addr() {
                    Ok(addr) if url.ends_with(":0") => format!("{scheme}://{addr}"),
                    _ => url,
                };
                let links = space_server::cluster::Links::new(cluster_tls.as_ref().map(|t| t.client.clone()));
                tokio::spawn(space_server::cluster::heartbeats(
                    platform.clone(),
                    links.clone(),
                    node.control_plane,
                    token.clone(),
                    node.id,
                    url,
                ));
                space_server::AppState::node(platform, token, links)
            }
            _ => space_server::AppState::new(platform, key),
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!("SPACE listening on {scheme}://{}", listener.local_addr()?);
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
            tracing::info!("shutting down");
        };
        let platform = state.platform.clone();
        space_server::http::serve_with(listener, state, tls, shutdown).await?;
        // Warm sandboxes belong to no one; the others keep running.
        platform.warm.drain().await;
        Ok(())
    })
}

/// The dev key: created once (0600), then reused; two servers starting at
/// once on a fresh data dir get the same one.
fn dev_key(path: &Path) -> Result<String> {
    let content = space_host::datadir::create_once(path, 0o600, || {
        let mut bytes = [0u8; 24];
        getrandom::getrandom(&mut bytes).map_err(std::io::Error::other)?;
        Ok(format!("space_dev_{}\n", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()).into_bytes())
    })
    .with_context(|| format!("the dev key ({})", path.display()))?;
    let key = String::from_utf8_lossy(&content).trim().to_string();
    anyhow::ensure!(!key.is_empty(), "the dev key file {} is empty: remove it to make a new one", path.display());
    Ok(key)
}

fn sandbox(command: SandboxCommand) -> Result<()> {
    match command {
        SandboxCommand::Create {
            template,
            vcpus,
            memory_mib,
            disk_mib,
            env,
            labels,
            network,
            no_wait,
            quiet,
            client,
        } => {
            let client = client.client()?;
            let network = network.to_json().map(serde_json::from_value).transpose()?;
            let request = space_api::CreateSandboxRequest {
                template,
                vcpus,
                memory_mib,
                disk_mib,
                env: env.into_iter().collect(),
                labels: labels.into_iter().collect(),
                lifecycle: None,
                network,
            };
            let accepted = client.post("/v1/sandboxes", &serde_json::to_value(&request)?)?;
            let id = accepted["sandbox"]["id"].as_str().unwrap_or_default().to_string();
            if !no_wait {
                let op_id = accepted["operation"]["id"].as_str().unwrap_or_default();
                eprintln!("accepted {id}; waiting for operation {op_id} (accepted is not ready)");
                let operation = client.wait_operation(op_id)?;
                if operation["state"] != "succeeded" {
                    bail!("create failed: {}", operation["error"]["message"].as_str().unwrap_or("unknown error"));
                }
            }
            match (quiet, no_wait) {
                (true, _) => println!("{id}"),
                (false, true) => print_json(&accepted),
                (false, false) => print_json(&client.get(&format!("/v1/sandboxes/{id}"))?),
            }
        }
        SandboxCommand::Ls { state, client } => {
            let path = match state {
                Some(state) => format!("/v1/sandboxes?state={state}"),
                None => "/v1/sandboxes".to_string(),
            };
            let list = client.client()?.get(&path)?;
            println!("{:<26} {:<10} {:<10} {:<8} CREATED", "ID", "STATE", "TEMPLATE", "ENGINE");
            for s in list["sandboxes"].as_array().into_iter().flatten() {
                println!(
                    "{:<26} {:<10} {:<10} {:<8} {}",
                    s["id"].as_str().unwrap_or(""),
                    s["state"].as_str().unwrap_or(""),
                    s["template"].as_str().unwrap_or(""),
                    s["engine"].as_str().unwrap_or(""),
                    s["created_at"].as_str().unwrap_or("")
                );
            }
        }
        SandboxCommand::Get { id, client } => print_json(&client.client()?.get(&format!("/v1/sandboxes/{id}"))?),
        SandboxCommand::Network { id, network, client } => {
            let body = network.to_json().unwrap_or_else(|| serde_json::json!({"egress": "none"}));
            print_json(&client.client()?.put(&format!("/v1/sandboxes/{id}/network"), &body)?["network"])
        }
        SandboxCommand::Egress { id, client } => {
            let log = client.client()?.get(&format!("/v1/sandboxes/{id}/egress"))?;
            for event in log["events"].as_array().into_iter().flatten() {
                println!(
                    "{} {:<7} {:<8} {}:{} {}",
                    event["at"].as_str().unwrap_or(""),
                    event["via"].as_str().unwrap_or(""),
                    event["decision"].as_str().unwrap_or(""),
                    event["host"].as_str().unwrap_or(""),
                    event["port"],
                    event["reason"].as_str().or(event["rule"].as_str()).unwrap_or("")
                );
            }
        }
        SandboxCommand::Rm { id, client } => {
            let client = client.client()?;
            let accepted = client.delete(&format!("/v1/sandboxes/{id}"))?;
            finish_lifecycle(&client, &accepted, "delete")?;
            eprintln!("deleted {id}");
        }
        SandboxCommand::Pause { id, client } => {
            let client = client.client()?;
            let accepted = client.post(&format!("/v1/sandboxes/{id}/pause"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "pause")?;
            eprintln!("paused {id}");
        }
        SandboxCommand::Suspend { id, client } => {
            let client = client.client()?;
            let accepted = client.post(&format!("/v1/sandboxes/{id}/suspend"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "suspend")?;
            eprintln!("suspended {id}");
        }
        SandboxCommand::Resume { id, client } => {
            let client = client.client()?;
            let accepted = client.post(&format!("/v1/sandboxes/{id}/resume"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "resume")?;
            eprintln!("resumed {id}");
        }
        SandboxCommand::Fork { id, count, labels, client } => {
            let client = client.client()?;
            let labels: std::collections::BTreeMap<_, _> = labels.into_iter().collect();
            let body = serde_json::json!({"count": count, "labels": labels});
            let accepted = client.post(&format!("/v1/sandboxes/{id}/fork"), &body)?;
            let operation = finish_lifecycle(&client, &accepted, "fork")?;
            eprintln!("forked {id} (frozen {} ms)", operation["frozen_ms"]);
            for fork in accepted["sandboxes"].as_array().into_iter().flatten() {
                println!("{}", fork["id"].as_str().unwrap_or_default());
            }
        }
        SandboxCommand::Checkpoint { id, name, client } => {
            let client = client.client()?;
            let body = serde_json::json!({"name": name});
            let accepted = client.post(&format!("/v1/sandboxes/{id}/checkpoints"), &body)?;
            let operation = finish_lifecycle(&client, &accepted, "checkpoint")?;
            eprintln!("checkpoint {name} of {id} saved (frozen {} ms)", operation["frozen_ms"]);
        }
        SandboxCommand::Checkpoints { id, client } => {
            let list = client.client()?.get(&format!("/v1/sandboxes/{id}/checkpoints"))?;
            println!("{:<24} {:>10} {:<9} CREATED", "NAME", "SIZE_MIB", "COMMANDS");
            for c in list["checkpoints"].as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:>10} {:<9} {}",
                    c["name"].as_str().unwrap_or(""),
                    c["size_bytes"].as_u64().unwrap_or(0).div_ceil(1 << 20),
                    c["commands"].as_array().map_or(0, Vec::len),
                    c["created_at"].as_str().unwrap_or("")
                );
            }
        }
        SandboxCommand::Restore { id, name, client } => {
            let client = client.client()?;
            let accepted =
                client.post(&format!("/v1/sandboxes/{id}/checkpoints/{name}/restore"), &serde_json::json!({}))?;
            finish_lifecycle(&client, &accepted, "restore")?;
            eprintln!("{id} rolled back to checkpoint {name}");
        }
        SandboxCommand::RmCheckpoint { id, name, client } => {
            client.client()?.delete_empty(&format!("/v1/sandboxes/{id}/checkpoints/{name}"))?;
            eprintln!("deleted checkpoint {name} of {id}");
        }
    }
    Ok(())
}

/// Waits for the operation a lifecycle call started; its failure is ours.
fn finish_lifecycle(client: &client::Client, accepted: &serde_json::Value, what: &str) -> Result<serde_json::Value> {
    let operation = client.wait_operation(accepted["operation"]["id"].as_str().unwrap_or_default())?;
    if operation["state"] != "succeeded" {
        bail!("{what} failed: {}", operation["error"]["message"].as_str().unwrap_or("unknown error"));
    }
    Ok(operation)
}

fn run_code(args: RunArgs) -> Result<i32> {
    use std::io::{Read, Write};
    let client = args.client.client()?;
    let base = format!("/v1/sandboxes/{}/contexts", args.sandbox);
    let code = match args.code.as_str() {
        "-" => {
            let mut code = String::new();
            std::io::stdin().read_to_string(&mut code)?;
            code
        }
        code => code.to_string(),
    };
    let _ = args.python; // Python is the one language so far.
    let (context, made) = match args.context {
        Some(context) => (context, false),
        None => {
            let made = client.post(&base, &serde_json::json!({"language": "python"}))?;
            (made["id"].as_str().unwrap_or_default().to_string(), true)
        }
    };
    let body = serde_json::json!({"code": code, "timeout_s": args.timeout});
    let mut code = 0;
    let reader = client.post_reader(&format!("{base}/{context}/run"), &body)?;
    for line in std::io::BufRead::lines(std::io::BufReader::new(reader)) {
        let event: serde_json::Value = serde_json::from_str(&line?)?;
        match event["type"].as_str() {
            Some("stdout") => print!("{}", event["text"].as_str().unwrap_or_default()),
            Some("stderr") => eprint!("{}", event["text"].as_str().unwrap_or_default()),
            Some("result") => {
                let data = &event["data"];
                if let Some(text) = data["text/plain"].as_str().filter(|_| event["is_main_result"] == true) {
                    println!("{text}");
                }
                for (mime, value) in data.as_object().into_iter().flatten() {
                    if mime.starts_with("image/") {
                        eprintln!("[{mime}, {} bytes base64]", value.as_str().map_or(0, str::len));
                    }
                }
            }
            Some("error") => {
                for line in event["traceback"].as_array().into_iter().flatten() {
                    eprintln!("{}", line.as_str().unwrap_or_default());
                }
                code = 1;
            }
            Some("end") if event["status"] != "ok" && code == 0 => {
                eprintln!("the run ended: {}", event["status"].as_str().unwrap_or("unknown"));
                code = 1;
            }
            _ => {}
        }
        std::io::stdout().flush()?;
    }
    if made {
        let _ = client.delete_empty(&format!("{base}/{context}"));
    }
    Ok(code)
}

fn exec(args: ExecArgs) -> Result<i32> {
    let client = args.client.client()?;
    let request = space_api::CommandRequest {
        argv: Some(args.argv),
        env: args.env.into_iter().collect(),
        cwd: args.cwd,
        timeout_s: args.timeout.unwrap_or(0),
        // Left out with `-t` alone: the terminal is the command's stdin.
        stdin: args.interactive.then_some(true),
        tty: args.tty,
        ..Default::default()
    };
    let created = client.post(&format!("/v1/sandboxes/{}/commands", args.sandbox), &serde_json::to_value(&request)?)?;
    if args.interactive || args.tty {
        let attach = created["command"]["attach"]["ws"].as_str().context("no attach link in the answer")?;
        let command =
            format!("/v1/sandboxes/{}/commands/{}", args.sandbox, created["command"]["id"].as_str().unwrap_or(""));
        return attach::interactive(&client, attach, &command, args.tty);
    }
    let output_path =
        created["command"]["attach"]["output"].as_str().context("no output link in the answer")?.to_string();
    let result = client.stream_output(&output_path)?;
    if let Some(error) = result.error.as_deref() {
        eprintln!("space: {error}");
    }
    Ok(match (result.exit_code, result.signal.as_deref()) {
        (Some(code), _) => code,
        (None, Some(signal)) => {
            eprintln!("space: the command was killed by SIG{signal}");
            128 + signal_number(signal)
        }
        (None, None) => 255,
    })
}

/// Follows a build operation with a progress bar (steps, and bytes or
/// packages within a step); on failure prints the build log.
fn follow_build(client: &client::Client, name: &str, op: &str) -> Result<()> {
    let bar = indicatif::ProgressBar::new(4);
    bar.set_style(
        indicatif::ProgressStyle::with_template("building {prefix} [{bar:20}] {pos}/{len} {elapsed} {wide_msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_prefix(name.to_string());
    let operation = loop {
        let operation = client.get(&format!("/v1/operations/{op}?wait=1"))?;
        let progress = &operation["progress"];
        bar.set_position(progress["done"].as_u64().unwrap_or(0));
        let mut message = progress["step"].as_str().unwrap_or("").to_string();
        let amount = &progress["amount"];
        if let (Some(done), Some(total)) = (amount["done"].as_u64(), amount["total"].as_u64()) {
            message = match amount["unit"].as_str() {
                Some("bytes") => {
                    format!("{message} ({} of {})", indicatif::HumanBytes(done), indicatif::HumanBytes(total))
                }
                unit => format!("{message} ({done} of {total} {})", unit.unwrap_or("")),
            };
        }
        bar.set_message(message);
        if matches!(operation["state"].as_str(), Some("succeeded" | "failed" | "cancelled")) {
            break operation;
        }
    };
    bar.finish_and_clear();
    if operation["state"] != "succeeded" {
        let log = client.get_text(&format!("/v1/operations/{op}/log")).unwrap_or_default();
        eprintln!("{log}");
        bail!("building {name} failed: {}", operation["error"]["message"].as_str().unwrap_or("unknown error"));
    }
    print_json(&client.get(&format!("/v1/templates/{name}"))?);
    Ok(())
}

fn template(command: TemplateCommand) -> Result<()> {
    match command {
        TemplateCommand::Build { name, debian_packages, suite, client } => {
            let client = client.client()?;
            let request =
                serde_json::json!({"name": name, "from": {"debian": {"suite": suite, "packages": debian_packages}}});
            let accepted = client.post("/v1/templates", &request)?;
            follow_build(&client, &name, accepted["operation"]["id"].as_str().unwrap_or_default())?;
        }
        TemplateCommand::ImportOci { file, name, workdir, user, client } => {
            let client = client.client()?;
            let archive = std::fs::File::open(&file).with_context(|| format!("opening {}", file.display()))?;
            let size = archive.metadata()?.len();
            let bar = indicatif::ProgressBar::new(size).with_style(
                indicatif::ProgressStyle::with_template(
                    "uploading {prefix} [{bar:20}] {bytes}/{total_bytes} {bytes_per_sec}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_prefix(name.clone());
            let mut query = format!("/v1/templates?name={}", client::encode(&name));
            for (key, value) in [("workdir", workdir), ("user", user)] {
                if let Some(value) = value {
                    query.push_str(&format!("&{key}={}", client::encode(&value)));
                }
            }
            let accepted = client.post_stream(&query, "application/x-tar", bar.wrap_read(archive));
            bar.finish_and_clear();
            let accepted = accepted?;
            follow_build(&client, &name, accepted["operation"]["id"].as_str().unwrap_or_default())?;
        }
        TemplateCommand::ImportDir { dir, name, data_dir, engine } => {
            let data = space_host::datadir::DataDir::open(&data_dir)?;
            let template =
                space_host::template::import_dir(&data, &name, &dir, &Default::default(), &engine.agent_bin()?, |p| {
                    eprintln!("import: {}", p.step)
                })?;
            eprintln!("template {name}: version {}", template.meta.version);
        }
        TemplateCommand::FromSandbox { name, sandbox, checkpoint, client } => {
            let client = client.client()?;
            let from = match checkpoint {
                Some(checkpoint) => serde_json::json!({"checkpoint": {"sandbox": sandbox, "name": checkpoint}}),
                None => serde_json::json!({"sandbox": sandbox}),
            };
            let accepted = client.post("/v1/templates", &serde_json::json!({"name": name, "from": from}))?;
            finish_lifecycle(&client, &accepted, "the snapshot template")?;
            eprintln!("template {name}: ready");
        }
        TemplateCommand::Ls { client } => {
            let list = client.client()?.get("/v1/templates")?;
            println!("{:<24} {:<9} {:<8} CREATED", "NAME", "STATE", "VERSION");
            for t in list["templates"].as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:<9} {:<8} {}",
                    t["name"].as_str().unwrap_or(""),
                    t["state"].as_str().unwrap_or(""),
                    t["version"].as_u64().map(|v| v.to_string()).unwrap_or_default(),
                    t["created_at"].as_str().unwrap_or("")
                );
            }
        }
        TemplateCommand::Get { name, client } => print_json(&client.client()?.get(&format!("/v1/templates/{name}"))?),
        TemplateCommand::Rm { name, client } => {
            client.client()?.delete_empty(&format!("/v1/templates/{name}"))?;
            eprintln!("deleted template {name}");
        }
    }
    Ok(())
}

/// `SBX:/path` as (sandbox, path); anything else is a local path.
fn remote(spec: &str) -> Option<(&str, &str)> {
    let (sandbox, path) = spec.split_once(':')?;
    (sandbox.starts_with("sbx_") && path.starts_with('/')).then_some((sandbox, path))
}

fn copy(client: &client::Client, from: &str, to: &str, mode: Option<String>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    match (remote(from), remote(to)) {
        (None, Some((sandbox, path))) => {
            let meta = std::fs::metadata(from).with_context(|| format!("reading {from}"))?;
            if meta.is_dir() {
                // A directory travels as a tar archive, unpacked into `path`.
                let mut builder = tar::Builder::new(Vec::new());
                builder.follow_symlinks(false);
                builder.append_dir_all(".", from).with_context(|| format!("archiving {from}"))?;
                let archive = builder.into_inner()?;
                return client.upload_tar(sandbox, path, archive);
            }
            if !meta.is_file() {
                bail!("{from} is neither a regular file nor a directory");
            }
            let file = std::fs::File::open(from).with_context(|| format!("opening {from}"))?;
            let mode = mode.unwrap_or_else(|| format!("{:04o}", meta.permissions().mode() & 0o7777));
            client.upload(sandbox, path, &mode, file)
        }
        (Some((sandbox, path)), None) => {
            if client.is_dir(sandbox, path)? {
                let archive = client.download_tar(sandbox, path)?;
                return unpack_here(&archive, std::path::Path::new(to));
            }
            // Into a temporary file first: a failed copy leaves `to` as it was.
            let partial = format!("{to}.space-partial");
            let mut out = std::fs::File::create(&partial).with_context(|| format!("creating {partial}"))?;
            let copied = client
                .download(sandbox, path, &mut out)
                .and_then(|()| std::fs::rename(&partial, to).with_context(|| format!("renaming {partial} to {to}")));
            if copied.is_err() {
                let _ = std::fs::remove_file(&partial);
            }
            copied
        }
        _ => bail!("give one local path and one SANDBOX:/absolute/path"),
    }
}

/// Unpacks an archive that came out of a sandbox (so: untrusted) into
/// `dir`, refusing any entry that would land outside it.
fn unpack_here(archive: &[u8], dir: &std::path::Path) -> Result<()> {
    Ok(space_host::download::unpack_within(archive, dir)?)
}

pub(crate) fn signal_number(name: &str) -> i32 {
    format!("SIG{name}").parse::<nix::sys::signal::Signal>().map(|s| s as i32).unwrap_or(0)
}
