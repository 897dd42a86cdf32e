//! The command line: every command, argument and flag of `space`, as clap
//! defines them, and the small conversions that belong to the arguments
//! (a client from `ClientArgs`, a platform config from `EngineArgs`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use space_host::template::{CODE_INTERPRETER_TEMPLATE, POLYGLOT_TEMPLATE};

use crate::client;

pub(crate) const DEFAULT_DATA_DIR: &str = "/var/lib/space";

pub(crate) const DEFAULT_URL: &str = "http://127.0.0.1:7070";

#[derive(Parser)]
#[command(name = "space", version, about = "SPACE: isolated sandboxes for agent-written code")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Top,
}

#[derive(Subcommand)]
pub(crate) enum Top {
    /// Prepare this host: packages, a btrfs data dir, the `base` template.
    Setup(SetupArgs),
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
    /// Volumes: storage of yours that outlives sandboxes, mounted into
    /// them at create (`space sandbox create --volume NAME:/path`).
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Copy a file or directory into or out of a sandbox or a volume:
    /// `LOCAL SBX:/path`, `SBX:/path LOCAL`, `LOCAL vol:NAME:/path`,
    /// `vol:NAME:/path LOCAL`, or between a sandbox and a volume.
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
    Bench(BenchArgs),
    /// Serve the Model Context Protocol on stdin/stdout: tools that create
    /// sandboxes, run commands and move files (uses SPACE_URL, SPACE_API_KEY).
    Mcp {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Serve the gVisor engine's root work to one unprivileged uid on a
    /// Unix socket (the privileged helper; `space serve --helper-socket`).
    Helper(HelperArgs),
    /// The confined child that parses one image archive for a template
    /// build: started by the helper (or a server without one), never by hand
    /// (decision 027).
    #[command(name = "import-oci-child", hide = true)]
    ImportOciChild(ImportChildArgs),
    /// The confined child that serves one volume's files on its stdin and
    /// stdout: started by the helper (or a server without one), never by
    /// hand (decision 031).
    #[command(name = "volume-files-child", hide = true)]
    VolumeFilesChild {
        /// The volume's `data`; it becomes the child's root.
        #[arg(long)]
        data: PathBuf,
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
pub(crate) enum SecretCommand {
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
pub(crate) enum KeysCommand {
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
        /// Print the key in the shape E2B's SDK checks for (`e2b_` and hex:
        /// the same key, for `E2B_API_KEY`) instead.
        #[arg(long)]
        e2b: bool,
    },
    /// Print a key read from standard input (the server's own key, the dev
    /// key) in the shape E2B's SDK checks for: `e2b_` and hex, the same key.
    E2b,
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

/// Where the API is and how to authenticate.
#[derive(Args, Clone)]
pub(crate) struct ClientArgs {
    /// The server's URL.
    #[arg(long, env = "SPACE_URL", default_value = DEFAULT_URL, global = true)]
    pub(crate) url: String,
    /// The API key (default: the dev key in --data-dir, if readable).
    #[arg(long, env = "SPACE_API_KEY", hide_env_values = true, global = true)]
    pub(crate) api_key: Option<String>,
    /// Data dir whose dev-api-key (DATA_DIR/state/dev-api-key) to use when no key is given.
    #[arg(long = "key-data-dir", env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR, global = true)]
    pub(crate) key_data_dir: PathBuf,
}

impl ClientArgs {
    pub(crate) fn client(&self) -> Result<client::Client> {
        let key = match &self.api_key {
            Some(key) => key.clone(),
            None => std::fs::read_to_string(space_host::datadir::dev_key_path(&self.key_data_dir))
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
pub(crate) struct NodeArgs {
    #[command(flatten)]
    pub(crate) serve: ServeArgs,
    /// The control plane's URL (`http://host:port`), or several replicas'
    /// (comma-separated; one that does not answer is passed over).
    #[arg(long)]
    pub(crate) control_plane: String,
    /// This node's name in the cluster (default: the host name).
    #[arg(long)]
    pub(crate) node_id: Option<String>,
    /// Where the control plane reaches this node (default: the address it
    /// listens on).
    #[arg(long)]
    pub(crate) advertise: Option<String>,
}

#[derive(Args)]
pub(crate) struct ServeArgs {
    #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub(crate) data_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub(crate) listen: SocketAddr,
    /// Development mode: loopback only, with a generated key in DATA_DIR/state/dev-api-key.
    #[arg(long)]
    pub(crate) dev: bool,
    /// File holding the operator's API key (required without --dev);
    /// tenants' keys come from `space keys create`.
    #[arg(long)]
    pub(crate) api_key_file: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// Serve each sandbox port also on a host name of its own,
    /// `{port}-{sandbox id}.DOMAIN` (point wildcard DNS, and for HTTPS a
    /// wildcard certificate, for `*.DOMAIN` at this server). The API is
    /// never served on a host under DOMAIN.
    #[arg(long, value_name = "DOMAIN")]
    pub(crate) preview_domain: Option<String>,
    /// Serve plain HTTP on a non-loopback address (keys then cross the
    /// network in clear text; only behind a TLS-terminating proxy).
    #[arg(long)]
    pub(crate) insecure_http: bool,
    /// Serve `GET /metrics` without a key (for a Prometheus scraper on a
    /// trusted network); by default it needs the server's own key, as it
    /// shows figures of every tenant together.
    #[arg(long)]
    pub(crate) metrics_without_key: bool,
    /// `text` or `json` (one object per line, with request ids).
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
    /// Ask the root helper on this socket (`space helper`) for the gVisor
    /// engine's root work instead of doing it in this process.
    /// With it, this process confines itself before it reads a byte of
    /// a request: no capabilities, no_new_privs, a seccomp filter, and
    /// Landlock limiting it to the data dir's state/, logs/ and
    /// run/uploads/ for writing.
    #[arg(long)]
    pub(crate) helper_socket: Option<PathBuf>,
    /// With --helper-socket, when started as root: become this user (a name
    /// or a uid; the helper's --allow-uid) first.
    #[arg(long, requires = "helper_socket")]
    pub(crate) user: Option<String>,
    /// Keep state in this PostgreSQL database (`postgres://user@host/db`)
    /// instead of the data dir's SQLite file (made if missing).
    #[arg(long, env = "SPACE_DATABASE", hide_env_values = true)]
    pub(crate) database: Option<String>,
    /// Be a cluster's control plane (needs --database and
    /// --node-token-file): no sandboxes here, requests go to the nodes.
    #[arg(long, requires = "database", requires = "node_token_file")]
    pub(crate) cluster: bool,
    /// The cluster's node token (the control plane and its nodes share it).
    #[arg(long)]
    pub(crate) node_token_file: Option<PathBuf>,
    /// A control plane's key that seals tenants' secrets in PostgreSQL: 32
    /// bytes, or 64 hex digits (`openssl rand -hex 32`), the same file on
    /// every replica. Without it the control plane keeps no secrets.
    #[arg(long, requires = "cluster")]
    pub(crate) secrets_key_file: Option<PathBuf>,
    /// The CA (PEM) of a cluster's own links: with --cluster-cert and
    /// --cluster-key, control plane and nodes speak mutual TLS to each
    /// other, each side asking the other for a certificate of this CA.
    #[arg(long, requires_all = ["cluster_cert", "cluster_key"])]
    pub(crate) cluster_ca: Option<PathBuf>,
    /// This member's certificate on the cluster's links (PEM, signed by
    /// --cluster-ca); a node serves its API with it.
    #[arg(long, requires = "cluster_ca")]
    pub(crate) cluster_cert: Option<PathBuf>,
    /// The key of --cluster-cert (PEM).
    #[arg(long, requires = "cluster_ca")]
    pub(crate) cluster_key: Option<PathBuf>,
    /// A control plane: also take nodes' heartbeats here, over the
    /// cluster's mutual TLS (give nodes this address as --control-plane
    /// https://…).
    #[arg(long, requires = "cluster_ca", requires = "cluster")]
    pub(crate) cluster_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
}

impl ServeArgs {
    /// The cluster's TLS, if asked for.
    pub(crate) fn cluster_tls(&self) -> Result<Option<space_server::http::ClusterTls>> {
        match (&self.cluster_ca, &self.cluster_cert, &self.cluster_key) {
            (Some(ca), Some(cert), Some(key)) => Ok(Some(space_server::http::cluster_tls(ca, cert, key)?)),
            _ => Ok(None),
        }
    }
}

#[derive(Args, Clone)]
pub(crate) struct EngineArgs {
    /// The statically linked guest agent.
    #[arg(long, env = "SPACE_AGENT_BIN")]
    pub(crate) agent_bin: Option<PathBuf>,
    /// The runsc binary.
    #[arg(long, env = "SPACE_RUNSC", default_value = "runsc")]
    pub(crate) runsc: PathBuf,
    /// Warm (pre-started, paused) sandboxes kept per template for fast create.
    #[arg(long, env = "SPACE_WARM_POOL", default_value_t = 2)]
    pub(crate) warm_pool: u32,
    /// Hot (running, agent connected) sandboxes kept per template in front
    /// of the warm ones: a create of the default shape is then an identity
    /// hand-off (each dozes while it waits: ≈ 0.3 % of a core under gVisor).
    #[arg(long, env = "SPACE_HOT_POOL", default_value_t = 1)]
    pub(crate) hot_pool: u32,
    /// Memory (MiB) the host may promise to sandboxes; default: host memory less 1 GiB.
    #[arg(long, env = "SPACE_CAPACITY_MIB")]
    pub(crate) capacity_mib: Option<u64>,
    /// Also build ext4 root drives (Firecracker's) for templates; default:
    /// when the host has hardware virtualization.
    #[arg(long, env = "SPACE_EXT4_IMAGES")]
    pub(crate) ext4_images: Option<bool>,
    /// The engine: auto (Firecracker where it can run, else gVisor),
    /// gvisor, or firecracker.
    #[arg(long, env = "SPACE_ENGINE", default_value = "auto")]
    pub(crate) engine: space_server::EngineChoice,
    /// The firecracker binary (its jailer is looked for beside it).
    #[arg(long, env = "FIRECRACKER_BIN")]
    pub(crate) firecracker_bin: Option<PathBuf>,
    /// Seconds a running sandbox may sit idle (no command running, no
    /// request) before the server pauses it; its next command or file
    /// request resumes it first. 0: never.
    #[arg(long, env = "SPACE_AUTO_PAUSE_S", default_value_t = space_server::DEFAULT_AUTO_PAUSE_S)]
    pub(crate) auto_pause_s: u64,
    /// Output (MiB) kept per command; the rest is counted, not stored.
    #[arg(long, env = "SPACE_MAX_OUTPUT_MIB", default_value_t = space_server::platform::DEFAULT_MAX_OUTPUT_BYTES >> 20)]
    pub(crate) max_output_mib: u64,
    /// Output (MiB) kept per sandbox, all its commands together.
    #[arg(long, env = "SPACE_MAX_SANDBOX_OUTPUT_MIB",
        default_value_t = space_server::disk::DEFAULT_MAX_SANDBOX_OUTPUT_BYTES >> 20)]
    pub(crate) max_sandbox_output_mib: u64,
    /// Free space (MiB) of the data dir the host keeps: under it, creates,
    /// suspends, template builds and uploads get 507 and output is not kept.
    #[arg(long, env = "SPACE_DISK_RESERVE_MIB", default_value_t = space_server::disk::DEFAULT_DISK_RESERVE_MIB)]
    pub(crate) disk_reserve_mib: u64,
    /// A fixed answer for the egress gateway, NAME=IP or NAME=IP:PORT
    /// (repeatable; with a port, connections to NAME go to that port
    /// whatever port was asked): when given, names resolve only through
    /// these (an internal mirror, a test).
    #[arg(long = "egress-host", value_name = "NAME=IP[:PORT]")]
    pub(crate) egress_hosts: Vec<String>,
    /// PEM file of CA certificates the gateway also trusts for upstreams it
    /// terminates TLS to (repeatable; besides the system's roots).
    #[arg(long = "egress-trust", value_name = "FILE")]
    pub(crate) egress_trust: Vec<PathBuf>,
    /// Internal addresses (IP or CIDR, repeatable) sandboxes may reach
    /// through the gateway anyway; everything internal is refused otherwise.
    #[arg(long = "egress-allow-internal", value_name = "CIDR")]
    pub(crate) egress_allow_internal: Vec<String>,
    /// Connections each sandbox may have open through the gateway at once.
    #[arg(long, default_value_t = space_egress::gateway::MAX_CONNECTIONS)]
    pub(crate) egress_max_connections: usize,
    /// New connections each sandbox may open per second (429 past it).
    #[arg(long, default_value_t = space_egress::gateway::NEW_PER_SECOND)]
    pub(crate) egress_new_per_second: u32,
    /// MiB per second each sandbox's egress may move each way, all its
    /// connections together (0: unlimited).
    #[arg(long, default_value_t = 0)]
    pub(crate) egress_rate_mib: u64,
    /// A registry templates' images may be pulled from over plain HTTP and
    /// at a private or loopback address, HOST[:PORT] (repeatable); every
    /// other registry is HTTPS at a public address.
    #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
    pub(crate) insecure_registries: Vec<String>,
    /// A fixed answer for a registry's name, NAME=IP (repeatable): that
    /// name resolves to that address only (a registry without DNS).
    #[arg(long = "registry-host", value_name = "NAME=IP")]
    pub(crate) registry_hosts: Vec<String>,
    /// The registry of image references that name no host
    /// (`debian:bookworm-slim`); without one, such a reference is refused.
    #[arg(long, env = "SPACE_DEFAULT_REGISTRY", value_name = "HOST[:PORT]")]
    pub(crate) default_registry: Option<String>,
    /// A namespace put before one-component repositories of the default
    /// registry (`debian` → `NAMESPACE/debian`), for registries that keep
    /// their official images under one.
    #[arg(long, value_name = "NAMESPACE")]
    pub(crate) default_registry_namespace: Option<String>,
    /// A pull-through mirror of the default registry, HOST[:PORT]: tried
    /// first for anonymous pulls, the registry itself when it fails.
    #[arg(long, env = "SPACE_REGISTRY_MIRROR", value_name = "HOST[:PORT]")]
    pub(crate) registry_mirror: Option<String>,
    /// PEM file of CA certificates registries' TLS is also checked against
    /// (repeatable; besides the system's roots).
    #[arg(long = "registry-ca", value_name = "FILE")]
    pub(crate) registry_ca: Vec<PathBuf>,
    /// Disk (MiB) the layer chains of pulled images may keep cached; the
    /// least recently used go past it (templates made of them stay whole).
    #[arg(long, env = "SPACE_LAYER_CACHE_MIB", default_value_t = space_server::DEFAULT_LAYER_CACHE_MIB)]
    pub(crate) layer_cache_mib: u64,
    /// Keep volumes as images in DIR, a filesystem every node of a cluster
    /// mounts at the same path (NFS, CephFS), owned by root: a volume then
    /// goes to whichever node a sandbox that mounts it is placed on. A
    /// server beside a root helper needs the helper started with it too.
    #[arg(long, env = "SPACE_SHARED_VOLUMES", value_name = "DIR")]
    pub(crate) shared_volumes: Option<PathBuf>,
}

impl EngineArgs {
    /// The guest agent: `--agent-bin`, else a statically linked
    /// `space-agent` beside this binary, in the static build's target dir,
    /// or installed. It runs in roots and initramfs images that have no
    /// libc of its kind, so a dynamically linked one (such as the one
    /// `cargo build` leaves beside a debug `space`) is refused or passed over.
    pub(crate) fn agent_bin(&self) -> Result<PathBuf> {
        find_agent_bin(self.agent_bin.as_deref())
    }

    pub(crate) fn platform_config(&self, data_dir: &Path) -> Result<space_server::PlatformConfig> {
        self.config_with_agent(data_dir, self.agent_bin()?)
    }

    pub(crate) fn config_with_agent(
        &self,
        data_dir: &Path,
        agent_bin: PathBuf,
    ) -> Result<space_server::PlatformConfig> {
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
            // This very binary parses image archives, in a confined child of its own.
            importer_bin: std::env::current_exe().context("finding this binary, the importer")?,
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
            registry: self.registry_config()?,
            layer_cache_mib: self.layer_cache_mib,
            shared_volumes: self.shared_volumes.clone(),
        })
    }

    /// How templates' images are pulled (the CA files read now: a confined
    /// server cannot open them later).
    fn registry_config(&self) -> Result<space_image::RegistryConfig> {
        let extra_ca_pem = self
            .registry_ca
            .iter()
            .map(|path| std::fs::read(path).with_context(|| format!("reading --registry-ca {}", path.display())))
            .collect::<Result<_>>()?;
        let hosts = self
            .registry_hosts
            .iter()
            .map(|pair| {
                let (name, ip) = pair.split_once('=').with_context(|| format!("--registry-host {pair:?}: NAME=IP"))?;
                let ip =
                    ip.parse().with_context(|| format!("--registry-host {pair:?}: {ip:?} is not an IP address"))?;
                anyhow::ensure!(
                    !name.is_empty() && !name.contains(['/', ':', ' ']),
                    "--registry-host {pair:?}: a bad name"
                );
                Ok((name.to_ascii_lowercase(), ip))
            })
            .collect::<Result<_>>()?;
        Ok(space_image::RegistryConfig {
            hosts,
            insecure: self.insecure_registries.clone(),
            mirror: self.registry_mirror.clone(),
            default_registry: self.default_registry.clone(),
            default_namespace: self.default_registry_namespace.clone(),
            extra_ca_pem,
            user_agent: format!("space/{}", env!("CARGO_PKG_VERSION")),
        })
    }
}

/// The static agent: `given`, else beside this binary, built or installed
/// (see [`EngineArgs::agent_bin`]).
pub(crate) fn find_agent_bin(given: Option<&Path>) -> Result<PathBuf> {
    let is_static = |path: &Path| space_host::is_static_elf(path).unwrap_or(false);
    if let Some(path) = given {
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

/// `space helper`.
#[derive(Args)]
pub(crate) struct HelperArgs {
    #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub(crate) data_dir: PathBuf,
    /// The Unix socket to serve (made mode 0600, owned by --allow-uid).
    #[arg(long)]
    pub(crate) socket: PathBuf,
    /// The one uid whose processes may connect (checked with SO_PEERCRED).
    #[arg(long)]
    pub(crate) allow_uid: u32,
    /// The statically linked guest agent.
    #[arg(long, env = "SPACE_AGENT_BIN")]
    pub(crate) agent_bin: Option<PathBuf>,
    /// The runsc binary.
    #[arg(long, env = "SPACE_RUNSC", default_value = "runsc")]
    pub(crate) runsc: PathBuf,
    /// The firecracker binary (its jailer is looked for beside it): the
    /// helper runs the server's microVMs when it is found.
    #[arg(long, env = "FIRECRACKER_BIN")]
    pub(crate) firecracker_bin: Option<PathBuf>,
    /// Keep volumes as images in DIR, shared by every node (see `space
    /// serve --shared-volumes`).
    #[arg(long, env = "SPACE_SHARED_VOLUMES", value_name = "DIR")]
    pub(crate) shared_volumes: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
}

/// The hidden importer child's arguments (its archive is its stdin, its
/// log its stderr; see `space_engine::templates::importer`).
#[derive(Args)]
pub(crate) struct ImportChildArgs {
    /// The build dir holding `rootfs` and `work`; it becomes the child's root.
    #[arg(long)]
    pub(crate) build_dir: PathBuf,
    /// The most a compressed archive may decompress to.
    #[arg(long)]
    pub(crate) max_bytes: Option<u64>,
    /// The archive is a template's root another node exported.
    #[arg(long)]
    pub(crate) root_tar: bool,
    /// The archive is one layer blob, applied onto the root.
    #[arg(long, conflicts_with = "root_tar")]
    pub(crate) layer: bool,
    /// The layer blob's digest, checked.
    #[arg(long, requires = "layer")]
    pub(crate) layer_digest: Option<String>,
    /// The layer's uncompressed digest, checked.
    #[arg(long, requires = "layer")]
    pub(crate) diff_id: Option<String>,
}

/// A sandbox's egress policy on the command line.
#[derive(Args, Clone)]
pub(crate) struct NetworkArgs {
    /// none, allowlist or public (default: allowlist when --allow-host is
    /// given, else none).
    #[arg(long)]
    pub(crate) egress: Option<String>,
    /// An allowed host: `name`, `*.suffix`, IP or CIDR, with optional
    /// `:port[,port]` (repeatable).
    #[arg(long = "allow-host", value_name = "RULE")]
    pub(crate) allow: Vec<String>,
    /// A denied host, in the same forms (repeatable).
    #[arg(long = "deny-host", value_name = "RULE")]
    pub(crate) deny: Vec<String>,
    /// Bind a secret: the variable ENV holds a placeholder, and the gateway
    /// adds the secret NAME on HTTPS requests to its hosts (repeatable).
    #[arg(long = "secret", value_name = "ENV=NAME", value_parser = parse_pair)]
    pub(crate) secrets: Vec<(String, String)>,
}

impl NetworkArgs {
    /// The policy as the API takes it; `None` when nothing was given.
    pub(crate) fn to_json(&self) -> Option<serde_json::Value> {
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
pub(crate) enum SandboxCommand {
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
        /// Mount a volume of yours: NAME:/path, or NAME:/path:ro for
        /// read-only (repeatable; one read-write mount of a volume at a time).
        #[arg(long = "volume", value_name = "NAME:/PATH[:ro]", value_parser = parse_mount)]
        volumes: Vec<space_api::VolumeMount>,
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
pub(crate) struct RunArgs {
    pub(crate) sandbox: String,
    /// Python (a Jupyter kernel; needs the code-interpreter template).
    #[arg(long)]
    pub(crate) python: bool,
    /// The code (`-` reads it from stdin).
    #[arg(short = 'c', long = "code")]
    pub(crate) code: String,
    /// A context to run in (its state carries over); without it a new one
    /// is made for this run and stopped after.
    #[arg(long)]
    pub(crate) context: Option<String>,
    /// Interrupt the run after this many seconds.
    #[arg(long)]
    pub(crate) timeout: Option<u64>,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

#[derive(Args)]
pub(crate) struct ExecArgs {
    pub(crate) sandbox: String,
    /// Working directory inside the sandbox.
    #[arg(long)]
    pub(crate) cwd: Option<String>,
    /// Environment, KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e', value_parser = parse_pair)]
    pub(crate) env: Vec<(String, String)>,
    /// Kill the command after this many seconds.
    #[arg(long)]
    pub(crate) timeout: Option<u64>,
    /// Keep stdin open and send ours (over the attach WebSocket).
    #[arg(short = 'i', long)]
    pub(crate) interactive: bool,
    /// Run on a pseudo-terminal; our terminal goes into raw mode.
    #[arg(short = 't', long)]
    pub(crate) tty: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub(crate) argv: Vec<String>,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

#[derive(Subcommand)]
pub(crate) enum TemplateCommand {
    /// Build a template from a Dockerfile (`space template build NAME -f
    /// Dockerfile DIR`: RUN steps run in sandboxes of the build, each step
    /// a cached layer) or from Debian packages (`--debian-packages`),
    /// showing progress.
    Build {
        /// The template's name (or --name).
        #[arg(value_name = "NAME")]
        template: Option<String>,
        /// The build context, sent as a tar without what its `.dockerignore`
        /// excludes (with -f; default: the current directory).
        #[arg(value_name = "DIR", requires = "file")]
        context: Option<PathBuf>,
        #[arg(long)]
        name: Option<String>,
        /// The Dockerfile to build.
        #[arg(short = 'f', long = "file", value_name = "DOCKERFILE", conflicts_with_all = ["debian_packages", "suite"])]
        file: Option<PathBuf>,
        /// A build argument, KEY=VALUE (repeatable).
        #[arg(long = "build-arg", value_name = "KEY=VALUE", value_parser = parse_pair, requires = "file")]
        build_args: Vec<(String, String)>,
        /// The stage to build (default: the last).
        #[arg(long, requires = "file")]
        target: Option<String>,
        /// The tenant secret holding the password (with --registry-user) or
        /// token of the registry a `FROM` image is in.
        #[arg(long, value_name = "SECRET", requires = "file")]
        registry_secret: Option<String>,
        /// The registry user the secret is the password of.
        #[arg(long, value_name = "USER", requires = "registry_secret")]
        registry_user: Option<String>,
        /// Packages, comma-separated.
        #[arg(long, value_delimiter = ',')]
        debian_packages: Vec<String>,
        #[arg(long)]
        suite: Option<String>,
        /// The network of the build's RUN steps (default: none).
        #[command(flatten)]
        network: NetworkArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make a template of an image in an OCI registry, showing the pull's
    /// progress: `space template create NAME --from-image REF`.
    Create {
        /// The new template's name.
        name: String,
        /// The image: `HOST[:PORT]/REPO[:TAG][@sha256:DIGEST]` (a reference
        /// without a host needs the server's --default-registry).
        #[arg(long, value_name = "REF")]
        from_image: String,
        /// The tenant secret holding the registry's password (with
        /// --registry-user) or token.
        #[arg(long, value_name = "SECRET")]
        registry_secret: Option<String>,
        /// The registry user the secret is the password of.
        #[arg(long, value_name = "USER", requires = "registry_secret")]
        registry_user: Option<String>,
        /// Default working directory (over the image's WorkingDir).
        #[arg(long)]
        workdir: Option<String>,
        /// Default user (over the image's User).
        #[arg(long)]
        user: Option<String>,
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
        engine: Box<EngineArgs>,
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
pub(crate) enum VolumeCommand {
    /// Make a volume (empty, or a copy of one of your volumes' snapshots).
    Create {
        name: String,
        /// Its size quota (writes past it fail; default 1024), counted
        /// against your disk quota.
        #[arg(long)]
        size_mib: Option<u32>,
        /// Start as a copy of a snapshot: VOLUME/SNAPSHOT.
        #[arg(long, value_name = "VOLUME/SNAPSHOT", value_parser = parse_snapshot_ref)]
        from_snapshot: Option<space_api::SnapshotRef>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List your volumes: size, use and who mounts them.
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show one volume as JSON (its mounts and snapshots too).
    Get {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a volume and its snapshots (refused while a sandbox mounts it).
    Delete {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make, list, delete and restore a volume's snapshots.
    #[command(subcommand)]
    Snapshot(VolumeSnapshotCommand),
    /// List a directory of a volume, no sandbox needed (`space cp` with
    /// `vol:NAME:/path` copies files in and out).
    Ls {
        name: String,
        #[arg(default_value = "/")]
        path: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Remove a file (or, with --recursive, a directory) from a volume.
    Rm {
        name: String,
        path: String,
        #[arg(long, short)]
        recursive: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Move a volume to another node of a cluster (copied while nothing
    /// mounts it; sandboxes that mount it are then placed there).
    Move {
        name: String,
        #[arg(long)]
        node: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub(crate) enum VolumeSnapshotCommand {
    /// Snapshot a volume's files as they are now (copy-on-write: cheap).
    Create {
        volume: String,
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List a volume's snapshots.
    List {
        volume: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a snapshot of a volume.
    Delete {
        volume: String,
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Put a volume's files back as a snapshot holds them (refused while a
    /// sandbox mounts it; the snapshot stays).
    Restore {
        volume: String,
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub(crate) enum OpCommand {
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

pub(crate) fn parse_pair(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {text:?}"))
}

/// `--volume NAME:/path[:ro]` (`:rw` is accepted too); the server checks
/// the name and the path.
pub(crate) fn parse_mount(text: &str) -> Result<space_api::VolumeMount, String> {
    let (name, rest) = text
        .split_once(':')
        .filter(|(name, _)| !name.is_empty())
        .ok_or_else(|| format!("expected NAME:/PATH[:ro], got {text:?}"))?;
    let (path, read_only) = match (rest.strip_suffix(":ro"), rest.strip_suffix(":rw")) {
        (Some(path), _) => (path, true),
        (None, Some(path)) => (path, false),
        (None, None) => (rest, false),
    };
    Ok(space_api::VolumeMount { name: name.to_string(), path: path.to_string(), read_only })
}

/// `--from-snapshot VOLUME/SNAPSHOT`.
pub(crate) fn parse_snapshot_ref(text: &str) -> Result<space_api::SnapshotRef, String> {
    match text.split_once('/') {
        Some((volume, snapshot)) if !volume.is_empty() && !snapshot.is_empty() => {
            Ok(space_api::SnapshotRef { volume: volume.to_string(), snapshot: snapshot.to_string() })
        }
        _ => Err(format!("expected VOLUME/SNAPSHOT, got {text:?}")),
    }
}

/// How `space serve` writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Lines for people.
    Text,
    /// One JSON object per line, with the request's span (request id,
    /// route, tenant, sandbox or operation id) in each.
    Json,
}

/// `space setup`.
#[derive(Args)]
pub(crate) struct SetupArgs {
    #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub(crate) data_dir: PathBuf,
    /// Size of the sparse btrfs image made when the data dir is not on btrfs.
    #[arg(long, default_value_t = 64)]
    pub(crate) btrfs_image_gib: u64,
    /// Debian suite of the base template.
    #[arg(long, default_value = "bookworm")]
    pub(crate) suite: String,
    /// Do not install Debian packages (they must already be there).
    #[arg(long)]
    pub(crate) skip_packages: bool,
    /// Also build this template when missing (`polyglot`: a JDK, Go, Node,
    /// gcc/make, git and Python). Repeatable.
    #[arg(long = "with-template", value_parser = [POLYGLOT_TEMPLATE, CODE_INTERPRETER_TEMPLATE])]
    pub(crate) with_templates: Vec<String>,
    /// The system user the server runs as (made if missing, with a group
    /// of the same name); it owns state/, logs/ and run/uploads/ only.
    #[arg(long = "user", default_value = "space")]
    pub(crate) user: String,
    /// Where the helper's socket lives (root's, group --user, 0750).
    #[arg(long, default_value = "/run/space")]
    pub(crate) run_dir: PathBuf,
    /// Also write systemd units: space-helper.service (root, only the
    /// helper's capabilities) and space.service (--user, none), and a
    /// tmpfiles.d line that makes --run-dir at boot.
    #[arg(long)]
    pub(crate) systemd: bool,
    /// Where --systemd writes the units.
    #[arg(long, default_value = "/etc/systemd/system", requires = "systemd")]
    pub(crate) unit_dir: PathBuf,
    /// Where --systemd writes the tmpfiles.d line.
    #[arg(long, default_value = "/etc/tmpfiles.d", requires = "systemd")]
    pub(crate) tmpfiles_dir: PathBuf,
    /// Only the user, its directories, --run-dir and (with --systemd) the
    /// units, on a data dir setup has prepared before: no packages,
    /// templates or guest kernel.
    #[arg(long)]
    pub(crate) privileges_only: bool,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
}

/// `space bench`.
#[derive(Args)]
pub(crate) struct BenchArgs {
    /// A data dir prepared by `space setup`; the benchmark works in a scratch
    /// dir inside it and removes it afterwards.
    #[arg(long, env = "SPACE_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub(crate) data_dir: PathBuf,
    /// Sandboxes to create (each side).
    #[arg(short = 'n', long, default_value_t = 10)]
    pub(crate) runs: usize,
    /// `true` round trips per sandbox through the API.
    #[arg(long, default_value_t = 20)]
    pub(crate) execs: usize,
    /// `runsc exec true` runs per raw sandbox (slow: a process per call).
    #[arg(long, default_value_t = 3)]
    pub(crate) raw_execs: usize,
    #[arg(long, default_value = "base")]
    pub(crate) template: String,
    /// Skip the template figures (a `base` build and an image import).
    #[arg(long)]
    pub(crate) skip_templates: bool,
    /// Size of the generated image for the import figure, in MiB.
    #[arg(long, default_value_t = 512)]
    pub(crate) image_mib: u64,
    /// Live sandboxes a killed server leaves for the restart figures (0: skip them).
    #[arg(long, default_value_t = 100)]
    pub(crate) restart_sandboxes: usize,
    /// Instead of the figures above: only the restart figures.
    #[arg(long)]
    pub(crate) only_restart: bool,
    /// Leave out the privilege split's figures (the same work through one
    /// root process and through the root helper beside a confined server).
    #[arg(long)]
    pub(crate) skip_split: bool,
    /// Instead of the figures above: only the privilege split's.
    #[arg(long)]
    pub(crate) only_split: bool,
    /// Instead of the figures above: a template of an image in a registry
    /// on loopback, cold and cached, beside `skopeo copy` of the same image
    /// (Debian's docker-registry and skopeo; see `bench/pull.rs`).
    #[arg(long)]
    pub(crate) only_pull: bool,
    /// Instead of the figures above: volumes — create, a 1 GiB write to a
    /// volume against the sandbox's root, a snapshot of 1 GiB — beside the
    /// same work on the host (see `bench/volumes.rs`).
    #[arg(long)]
    pub(crate) only_volumes: bool,
    /// Instead of the figures above: only the previews' (a port's request
    /// on its own host name against the path form, and a 100 MiB download
    /// through a preview against the files route), which the full run
    /// also prints.
    #[arg(long)]
    pub(crate) only_previews: bool,
    /// Size of the generated image for --only-pull, in MiB.
    #[arg(long, default_value_t = 200)]
    pub(crate) pull_mib: u64,
    /// Instead of the figures above: keep this many sandboxes alive at once
    /// and report what they cost (see `bench/density.rs`).
    #[arg(long)]
    pub(crate) density: Option<usize>,
    /// Instead of the figures above: create and exec through a cluster's
    /// control plane to a node (a throwaway PostgreSQL from Debian's
    /// `postgresql`) next to a single-host server (see `bench/cluster.rs`).
    #[arg(long)]
    pub(crate) cluster: bool,
    /// With --density: seconds of idleness before the server pauses a sandbox.
    #[arg(long, default_value_t = 2)]
    pub(crate) idle_pause_s: u64,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
}
