//! A throwaway PostgreSQL cluster from Debian's `postgresql` package, for
//! tests and `space bench --cluster`: made with `initdb` in a temp dir,
//! listening on a free loopback port, trusting its one user (`space`),
//! stopped and removed when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

use space_process::Reaper;

pub struct Throwaway {
    dir: PathBuf,
    bin: PathBuf,
    netns: Option<String>,
    /// `postgres://space@127.0.0.1:PORT/postgres`
    pub url: String,
}

/// Runs one of PostgreSQL's programs, as the package's `postgres` user
/// when we are root (initdb refuses root), in network namespace `netns`
/// when given.
fn run(bin: &Path, netns: Option<&str>, program: &str, args: &[&str]) -> Result<(), String> {
    let mut command = match netns {
        Some(netns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{netns}"));
            c
        }
        None => Command::new("env"),
    };
    if nix::unistd::Uid::effective().is_root() {
        command.args(["runuser", "-u", "postgres", "--"]);
    }
    command.arg(bin.join(program));
    // Through the reaper: the calling process may reap every child itself.
    let output = Reaper::global().output(command.args(args)).map_err(|e| format!("running {program}: {e}"))?;
    match output.status.success() {
        true => Ok(()),
        false => Err(format!(
            "{program} {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )),
    }
}

impl Throwaway {
    pub fn start() -> Result<Throwaway, String> {
        Throwaway::start_in(None, "127.0.0.1", None)
    }

    /// In network namespace `netns` (a name under /run/netns), listening on
    /// `address`, and taking connections from `clients` (a CIDR) as well.
    pub fn start_in(netns: Option<&str>, address: &str, clients: Option<&str>) -> Result<Throwaway, String> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|b| b.join("initdb").exists())
            .max()
            .ok_or("PostgreSQL is missing: install Debian's postgresql package (scripts/test.sh does)")?;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("space-pg-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut cluster =
            Throwaway { dir: dir.clone(), bin: bin.clone(), netns: netns.map(str::to_string), url: String::new() };
        if nix::unistd::Uid::effective().is_root() {
            let user = nix::unistd::User::from_name("postgres")
                .ok()
                .flatten()
                .ok_or("the postgres user (from Debian's postgresql package) is missing")?;
            nix::unistd::chown(&dir, Some(user.uid), Some(user.gid)).map_err(|e| e.to_string())?;
        }
        let data = dir.join("data");
        let data = data.to_str().ok_or("a temp dir that is not UTF-8")?;
        run(&bin, netns, "initdb", &["-D", data, "--auth=trust", "-U", "space", "-E", "UTF8", "--no-sync"])?;
        if let Some(clients) = clients {
            let hba = dir.join("data/pg_hba.conf");
            let mut text = std::fs::read_to_string(&hba).map_err(|e| e.to_string())?;
            text.push_str(&format!("host all all {clients} trust\n"));
            std::fs::write(&hba, text).map_err(|e| e.to_string())?;
        }
        // A port free here is as good as any in a fresh namespace.
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let listen = if address == "127.0.0.1" { address.to_string() } else { format!("127.0.0.1,{address}") };
        let options =
            format!("-c listen_addresses={listen} -p {port} -k {} -c fsync=off -c max_connections=200", dir.display());
        let log = dir.join("log");
        let log = log.to_str().ok_or("a temp dir that is not UTF-8")?;
        run(&bin, netns, "pg_ctl", &["-D", data, "-o", &options, "-l", log, "-w", "-t", "60", "start"])?;
        cluster.url = format!("postgres://space@{address}:{port}/postgres");
        Ok(cluster)
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        if !self.url.is_empty() {
            let data = self.dir.join("data");
            if let Some(data) = data.to_str() {
                let _ = run(&self.bin, self.netns.as_deref(), "pg_ctl", &["-D", data, "-m", "immediate", "-w", "stop"]);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
