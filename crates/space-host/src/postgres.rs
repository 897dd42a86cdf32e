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
    /// `postgres://space@127.0.0.1:PORT/postgres`
    pub url: String,
}

/// Runs one of PostgreSQL's programs, as the package's `postgres` user
/// when we are root (initdb refuses root).
fn run(bin: &Path, program: &str, args: &[&str]) -> Result<(), String> {
    let mut command = match nix::unistd::Uid::effective().is_root() {
        true => {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin.join(program));
            c
        }
        false => Command::new(bin.join(program)),
    };
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
        let mut cluster = Throwaway { dir: dir.clone(), bin: bin.clone(), url: String::new() };
        if nix::unistd::Uid::effective().is_root() {
            let user = nix::unistd::User::from_name("postgres")
                .ok()
                .flatten()
                .ok_or("the postgres user (from Debian's postgresql package) is missing")?;
            nix::unistd::chown(&dir, Some(user.uid), Some(user.gid)).map_err(|e| e.to_string())?;
        }
        let data = dir.join("data");
        let data = data.to_str().ok_or("a temp dir that is not UTF-8")?;
        run(&bin, "initdb", &["-D", data, "--auth=trust", "-U", "space", "-E", "UTF8", "--no-sync"])?;
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let options =
            format!("-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=off -c max_connections=200", dir.display());
        let log = dir.join("log");
        let log = log.to_str().ok_or("a temp dir that is not UTF-8")?;
        run(&bin, "pg_ctl", &["-D", data, "-o", &options, "-l", log, "-w", "-t", "60", "start"])?;
        cluster.url = format!("postgres://space@127.0.0.1:{port}/postgres");
        Ok(cluster)
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        if !self.url.is_empty() {
            let data = self.dir.join("data");
            if let Some(data) = data.to_str() {
                let _ = run(&self.bin, "pg_ctl", &["-D", data, "-m", "immediate", "-w", "stop"]);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
