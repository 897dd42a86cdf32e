//! What a Firecracker sandbox boots: Debian's cloud kernel and an
//! initramfs whose `/init` is the agent, with the virtio and vsock modules
//! it loads before mounting the template's ext4 root drive.
//!
//! The kernel comes from `linux-image-cloud-amd64` (`apt-get download` and
//! unpack; Firecracker boots its bzImage). Its virtio drivers are modules,
//! so the initramfs carries them in dependency order (read from each
//! module's own `depends=`, since the package ships no `modules.dep`), and
//! `/modules.order` lists them for the agent.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::datadir::DataDir;
use crate::{run, HostError};

/// The metapackage that names the current cloud kernel.
pub const KERNEL_PACKAGE: &str = "linux-image-cloud-amd64";
/// Modules the guest needs before it can reach its root drive and the host.
pub const GUEST_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
];
/// Where the initramfs lists the modules to load, in order.
pub const MODULES_ORDER: &str = "modules.order";

/// The boot artifacts of the Firecracker engine.
#[derive(Debug, Clone)]
pub struct GuestArtifacts {
    /// The ELF kernel Firecracker loads (unpacked from Debian's bzImage).
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// The kernel release, such as `6.1.0-57-cloud-amd64`.
    pub release: String,
}

/// Where a data dir keeps the guest artifacts.
pub fn guest_dir(data: &DataDir) -> PathBuf {
    data.root().join("guest")
}

/// Firecracker on x86_64 loads an ELF `vmlinux`, not a bzImage: the ELF is
/// the bzImage's compressed payload (LZ4 in Debian's cloud kernel; gzip
/// is handled too), found by its magic and unpacked.
pub fn extract_vmlinux(bzimage: &[u8]) -> Result<Vec<u8>, HostError> {
    const LZ4_LEGACY: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
    const GZIP: [u8; 3] = [0x1f, 0x8b, 0x08];
    let is_elf = |bytes: &[u8]| bytes.starts_with(b"\x7fELF");
    for at in (0..bzimage.len().saturating_sub(4)).filter(|&i| bzimage[i..].starts_with(&LZ4_LEGACY)) {
        let elf = lz4_legacy(&bzimage[at + 4..]);
        if is_elf(&elf) {
            return Ok(elf);
        }
    }
    for at in (0..bzimage.len().saturating_sub(3)).filter(|&i| bzimage[i..].starts_with(&GZIP)) {
        let mut elf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bzimage[at..]), &mut elf);
        if is_elf(&elf) {
            return Ok(elf);
        }
    }
    Err(HostError::Invalid("no LZ4 or gzip payload holding an ELF kernel in the bzImage".into()))
}

/// An LZ4 "legacy" stream (as the kernel's build writes it): blocks of
/// `[u32 LE size][compressed]`, each at most 8 MiB unpacked, until a size
/// that does not fit (the kernel appends its unpacked length).
fn lz4_legacy(mut input: &[u8]) -> Vec<u8> {
    const BLOCK: usize = 8 << 20;
    let mut out = Vec::new();
    let mut block = vec![0u8; BLOCK];
    while input.len() >= 4 {
        let size = u32::from_le_bytes([input[0], input[1], input[2], input[3]]) as usize;
        if size == 0 || size > input.len() - 4 {
            break;
        }
        match lz4_flex::block::decompress_into(&input[4..4 + size], &mut block) {
            Ok(n) => out.extend_from_slice(&block[..n]),
            Err(_) => break,
        }
        input = &input[4 + size..];
    }
    out
}

/// The artifacts if they were built, without building them.
pub fn existing(data: &DataDir) -> Option<GuestArtifacts> {
    let dir = guest_dir(data);
    let release = fs::read_to_string(dir.join("release")).ok()?.trim().to_string();
    let artifacts = GuestArtifacts { kernel: dir.join("vmlinux"), initramfs: dir.join("initramfs.cpio"), release };
    (artifacts.kernel.is_file() && artifacts.initramfs.is_file()).then_some(artifacts)
}

/// Downloads the kernel (once) and builds the initramfs with `agent_bin`
/// as `/init` (again whenever the agent changed).
pub fn prepare(data: &DataDir, agent_bin: &Path, say: &dyn Fn(&str)) -> Result<GuestArtifacts, HostError> {
    check_init(agent_bin)?;
    let dir = guest_dir(data);
    fs::create_dir_all(&dir).map_err(HostError::io("creating the guest dir"))?;
    let unpacked = dir.join("kernel-package");
    let release = match fs::read_to_string(dir.join("release")) {
        Ok(release) if dir.join("vmlinux").is_file() && unpacked.is_dir() => release.trim().to_string(),
        _ => {
            say(&format!("downloading the guest kernel ({KERNEL_PACKAGE})"));
            download_kernel(&dir, &unpacked)?
        }
    };
    let modules_dir = unpacked.join("lib/modules").join(&release);
    let initramfs = dir.join("initramfs.cpio");
    let agent = fs::read(agent_bin).map_err(HostError::io(format!("reading the agent {}", agent_bin.display())))?;
    let modules = load_order(&modules_dir, GUEST_MODULES)?;
    let mut archive = Cpio::default();
    archive.dir("dev");
    archive.dir("proc");
    archive.dir("sys");
    archive.dir("newroot");
    archive.dir("lib");
    archive.dir("lib/modules");
    archive.file("init", 0o755, &agent);
    let mut order = String::new();
    for (name, path) in &modules {
        let bytes = fs::read(path).map_err(HostError::io(format!("reading module {name}")))?;
        archive.file(&format!("lib/modules/{name}.ko"), 0o644, &bytes);
        order.push_str(&format!("/lib/modules/{name}.ko\n"));
    }
    archive.file(MODULES_ORDER, 0o644, order.as_bytes());
    let bytes = archive.finish();
    // Unchanged, it is left as it is: Firecracker's template snapshots are
    // named after the guest files, and a rewrite would void them.
    if fs::read(&initramfs).is_ok_and(|old| old == bytes) {
        return Ok(GuestArtifacts { kernel: dir.join("vmlinux"), initramfs, release });
    }
    let partial = dir.join(".initramfs.cpio.partial");
    fs::write(&partial, &bytes).map_err(HostError::io("writing the initramfs"))?;
    fs::rename(&partial, &initramfs).map_err(HostError::io("publishing the initramfs"))?;
    Ok(GuestArtifacts { kernel: dir.join("vmlinux"), initramfs, release })
}

/// The agent becomes the initramfs's `/init`: with no libc or loader
/// there, only a statically linked one can run (the kernel would panic
/// with "No working init found").
fn check_init(agent_bin: &Path) -> Result<(), HostError> {
    let is_static =
        crate::is_static_elf(agent_bin).map_err(HostError::io(format!("reading the agent {}", agent_bin.display())))?;
    if is_static {
        return Ok(());
    }
    Err(HostError::Invalid(format!(
        "the agent {} is dynamically linked; the guest's /init must be a static build (scripts/run.sh and scripts/test.sh build one)",
        agent_bin.display()
    )))
}

/// `apt-get download` of the kernel package the metapackage depends on,
/// unpacked; returns the kernel release.
fn download_kernel(dir: &Path, unpacked: &Path) -> Result<String, HostError> {
    let depends = run(Command::new("apt-cache").args(["depends", KERNEL_PACKAGE]))?;
    let package = String::from_utf8_lossy(&depends)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: ").filter(|p| p.starts_with("linux-image-")).map(str::to_string))
        .ok_or_else(|| HostError::Invalid(format!("{KERNEL_PACKAGE} names no kernel package; run apt-get update")))?;
    let download = dir.join("download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).map_err(HostError::io("creating the download dir"))?;
    run(Command::new("apt-get").args(["download", &package]).current_dir(&download))?;
    let deb = fs::read_dir(&download)
        .map_err(HostError::io("reading the download dir"))?
        .filter_map(|e| Some(e.ok()?.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| HostError::Invalid(format!("apt-get download {package} left no .deb")))?;
    let _ = fs::remove_dir_all(unpacked);
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(unpacked))?;
    let _ = fs::remove_dir_all(&download);
    let release = package.trim_start_matches("linux-image-").to_string();
    let vmlinuz = unpacked.join("boot").join(format!("vmlinuz-{release}"));
    let bzimage = fs::read(&vmlinuz).map_err(HostError::io(format!("reading {}", vmlinuz.display())))?;
    fs::write(dir.join("vmlinux"), extract_vmlinux(&bzimage)?).map_err(HostError::io("writing vmlinux"))?;
    fs::copy(&vmlinuz, dir.join("vmlinuz")).map_err(HostError::io(format!("copying {}", vmlinuz.display())))?;
    fs::write(dir.join("release"), &release).map_err(HostError::io("recording the kernel release"))?;
    Ok(release)
}

/// The `.ko` files of `wanted` and what they depend on, dependencies first.
pub fn load_order(modules_dir: &Path, wanted: &[&str]) -> Result<Vec<(String, PathBuf)>, HostError> {
    let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
    index_modules(&modules_dir.join("kernel"), &mut files);
    let builtin = fs::read_to_string(modules_dir.join("modules.builtin")).unwrap_or_default();
    let builtin: HashSet<String> = builtin
        .lines()
        .filter_map(|l| Path::new(l).file_stem().map(|s| s.to_string_lossy().replace('-', "_")))
        .collect();
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    for name in wanted {
        visit(name, &files, &builtin, &mut seen, &mut order, 0)?;
    }
    Ok(order)
}

fn index_modules(dir: &Path, files: &mut BTreeMap<String, PathBuf>) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            index_modules(&path, files);
        } else if let Some(name) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".ko")) {
            files.insert(name.replace('-', "_"), path);
        }
    }
}

fn visit(
    name: &str,
    files: &BTreeMap<String, PathBuf>,
    builtin: &HashSet<String>,
    seen: &mut HashSet<String>,
    order: &mut Vec<(String, PathBuf)>,
    depth: usize,
) -> Result<(), HostError> {
    let name = name.replace('-', "_");
    if depth > 32 {
        return Err(HostError::Invalid(format!("module dependencies loop around {name}")));
    }
    if seen.contains(&name) || builtin.contains(&name) {
        return Ok(());
    }
    let path = files.get(&name).ok_or_else(|| HostError::Invalid(format!("the kernel has no module {name}")))?;
    let bytes = fs::read(path).map_err(HostError::io(format!("reading module {name}")))?;
    for dependency in module_depends(&bytes) {
        visit(&dependency, files, builtin, seen, order, depth + 1)?;
    }
    seen.insert(name.clone());
    order.push((name, path.clone()));
    Ok(())
}

/// The `depends=` list in a module's `.modinfo` strings.
fn module_depends(bytes: &[u8]) -> Vec<String> {
    let key = b"depends=";
    bytes
        .windows(key.len())
        .position(|w| w == key)
        .map(|at| {
            let rest = &bytes[at + key.len()..];
            let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
            String::from_utf8_lossy(&rest[..end]).split(',').filter(|s| !s.is_empty()).map(str::to_string).collect()
        })
        .unwrap_or_default()
}

/// A `newc` cpio archive, as the kernel unpacks an initramfs.
#[derive(Default)]
pub struct Cpio {
    out: Vec<u8>,
    inode: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.inode += 1;
        let fields = [self.inode, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, 0, 0, name.len() as u32 + 1, 0];
        let _ = write!(self.out, "070701");
        for field in fields {
            let _ = write!(self.out, "{field:08x}");
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    pub fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | mode, data);
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamically_linked_agent_is_refused_as_init() {
        // This test binary is dynamically linked, as a debug agent is.
        let err = check_init(&std::env::current_exe().unwrap()).unwrap_err().to_string();
        assert!(err.contains("dynamically linked") && err.contains("static build"), "{err}");
        assert!(check_init(Path::new("/nonexistent/space-agent")).is_err());
    }

    #[test]
    fn cpio_entries_are_newc_and_aligned() {
        let mut archive = Cpio::default();
        archive.dir("dev");
        archive.file("init", 0o755, b"#!x");
        let bytes = archive.finish();
        assert_eq!(bytes.len() % 4, 0);
        assert!(bytes.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("init\0") && text.contains("TRAILER!!!\0") && text.contains("#!x"));
        // The second header starts 4-aligned after "dev\0" and padding.
        let second = bytes.windows(6).skip(1).position(|w| w == b"070701").unwrap() + 1;
        assert_eq!(second % 4, 0);
        // mode of init: regular file, 0755.
        let mode = &bytes[second + 14..second + 22];
        assert_eq!(mode, b"000081ed");
    }

    #[test]
    fn module_dependencies_come_first() {
        let dir = std::env::temp_dir().join(format!("space-modules-{}", std::process::id()));
        let kernel = dir.join("kernel/drivers");
        fs::create_dir_all(&kernel).unwrap();
        fs::write(kernel.join("a.ko"), b"\x7fELF..\0name=a\0depends=b,c\0").unwrap();
        fs::write(kernel.join("b.ko"), b"\0depends=c\0").unwrap();
        fs::write(kernel.join("c.ko"), b"\0depends=\0").unwrap();
        fs::write(dir.join("modules.builtin"), "kernel/fs/ext4/ext4.ko\n").unwrap();
        let order: Vec<String> = load_order(&dir, &["a", "ext4"]).unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(order, ["c", "b", "a"]);
        assert!(load_order(&dir, &["missing"]).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
