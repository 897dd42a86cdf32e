//! Templates from OCI image archives (`docker save` and OCI layouts) made
//! here, layer by layer, imported through the API and run on real runsc.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{platform_config, TestServer};
use serde_json::{json, Value};
use space_host::oci::{write_archive, ArchiveFormat, ImageSettings};
use space_testkit::{busybox_static, TestDataDir};

/// Layer tars written into a work dir.
struct Layer {
    builder: tar::Builder<fs::File>,
    path: PathBuf,
}

impl Layer {
    fn new(dir: &Path, name: &str) -> Layer {
        let path = dir.join(format!("{name}.tar"));
        Layer { builder: tar::Builder::new(fs::File::create(&path).unwrap()), path }
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(1_700_000_000);
        header
    }

    fn dir(mut self, path: &str) -> Layer {
        let mut header = Self::header(tar::EntryType::Directory, 0o755, 0);
        self.builder.append_data(&mut header, path, std::io::empty()).unwrap();
        self
    }

    fn file(mut self, path: &str, mode: u32, content: &[u8]) -> Layer {
        let mut header = Self::header(tar::EntryType::Regular, mode, content.len() as u64);
        self.builder.append_data(&mut header, path, content).unwrap();
        self
    }

    fn symlink(mut self, path: &str, target: &str) -> Layer {
        let mut header = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.builder.append_link(&mut header, path, target).unwrap();
        self
    }

    fn hard_link(mut self, path: &str, target: &str) -> Layer {
        let mut header = Self::header(tar::EntryType::Link, 0o644, 0);
        self.builder.append_link(&mut header, path, target).unwrap();
        self
    }

    /// An entry whose name the tar crate would refuse to write (`..`,
    /// absolute), put into the header's bytes directly, as an attacker would.
    fn raw(mut self, kind: tar::EntryType, name: &str, link: &str, content: &[u8]) -> Layer {
        let mut header = Self::header(kind, 0o644, content.len() as u64);
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        header.set_cksum();
        self.builder.append(&header, content).unwrap();
        self
    }

    fn finish(self) -> PathBuf {
        self.builder.into_inner().unwrap();
        self.path
    }
}

/// A busybox base layer: a shell and the tools the checks use.
fn base_layer(dir: &Path) -> Layer {
    let busybox = fs::read(busybox_static()).unwrap();
    let mut layer = Layer::new(dir, "base").dir("bin").file("bin/busybox", 0o755, &busybox);
    for tool in ["sh", "cat", "ls", "echo", "pwd", "test", "rm", "id", "env", "cmp"] {
        layer = layer.symlink(&format!("bin/{tool}"), "busybox");
    }
    layer
        .hard_link("bin/busybox-again", "bin/busybox")
        .dir("etc")
        .file("etc/keep.txt", 0o644, b"kept\n")
        .file("etc/gone.txt", 0o644, b"whited out in layer 2\n")
        .dir("data")
        .file("data/old.txt", 0o644, b"hidden by an opaque dir\n")
}

/// The two-layer image of the issue: layer 2 adds a file, whites out
/// another, makes `data/` opaque, and the config sets env and workdir.
fn two_layer_image(dir: &Path, format: ArchiveFormat) -> PathBuf {
    let base = base_layer(dir).finish();
    let top = Layer::new(dir, "top")
        .file("hello.txt", 0o640, b"added in layer 2\n")
        .file("etc/.wh.gone.txt", 0o644, b"")
        .dir("data")
        .file("data/.wh..wh..opq", 0o644, b"")
        .file("data/new.txt", 0o644, b"new\n")
        .dir("work")
        .finish();
    let settings = ImageSettings {
        env: vec!["PATH=/bin".into(), "GREETING=hi from the image".into()],
        working_dir: Some("/work".into()),
        user: Some("0:0".into()),
    };
    let out = dir.join(format!("{format:?}.tar"));
    write_archive(&out, format, &[base, top], &settings).unwrap();
    out
}

fn work_dir(data: &TestDataDir, name: &str) -> PathBuf {
    let dir = data.root().join("work").join(name);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// Uploads an archive and waits for the import operation.
fn import(server: &TestServer, name: &str, archive: &Path) -> Value {
    let (status, accepted) = server.upload(&format!("/v1/templates?name={name}"), "application/x-tar", archive);
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(accepted["template"]["state"], "building");
    server.wait_operation(accepted["operation"]["id"].as_str().unwrap())
}

const CHECK: &str = "cat /hello.txt; test -e /etc/gone.txt && echo gone-present || echo gone-absent; \
    cat /etc/keep.txt; ls /data; echo \"$GREETING\"; pwd; id -u; cmp /bin/busybox /bin/busybox-again && echo linked";
const EXPECTED: &str = "added in layer 2\ngone-absent\nkept\nnew.txt\nhi from the image\n/work\n0\nlinked\n";

#[test]
fn a_docker_save_image_becomes_a_template_that_sandboxes_see_exactly() {
    let data = TestDataDir::new();
    let mut config = platform_config(&data);
    config.ext4_images = Some(true);
    let server = TestServer::start_with(config);
    let archive = two_layer_image(&work_dir(&data, "docker"), ArchiveFormat::DockerSave);

    let operation = import(&server, "twolayer", &archive);
    assert_eq!(operation["state"], "succeeded", "{operation}");
    let template = server.ok("GET", "/v1/templates/twolayer", None);
    assert_eq!(template["source"]["oci"]["format"], "docker-save", "{template}");
    assert_eq!(template["defaults"]["workdir"], "/work");
    assert_eq!(template["defaults"]["env"]["GREETING"], "hi from the image");
    assert_eq!(template["defaults"]["user"], "0:0");

    let first = server.create_sandbox(json!({"template": "twolayer"}));
    let seen = server.exec(&first, json!({"cmd": CHECK}));
    assert_eq!((seen["stdout"].as_str(), seen["result"]["exit_code"].as_i64()), (Some(EXPECTED), Some(0)), "{seen}");
    let modes = server.exec(&first, json!({"cmd": "ls -l /hello.txt /bin/sh"}));
    let listing = modes["stdout"].as_str().unwrap();
    assert!(listing.contains("-rw-r-----") && listing.contains("/bin/sh -> busybox"), "{listing}");

    // A sandbox's writes never reach the template: a second one sees the original.
    let wrote = server.exec(&first, json!({"cmd": "echo changed > /hello.txt; rm /etc/keep.txt; cat /hello.txt"}));
    assert_eq!(wrote["stdout"], "changed\n", "{wrote}");
    let second = server.create_sandbox(json!({"template": "twolayer", "env": {"GREETING": "overridden"}}));
    let fresh = server.exec(&second, json!({"cmd": "cat /hello.txt /etc/keep.txt; echo $GREETING"}));
    assert_eq!(fresh["stdout"], "added in layer 2\nkept\noverridden\n", "{fresh}");

    // The Firecracker root drive holds the same tree.
    let image = data.root().join("templates/twolayer/1/rootfs.ext4");
    space_testkit::run_within(std::process::Command::new("e2fsck").args(["-fn"]).arg(&image), space_testkit::PATIENCE)
        .expect("a clean ext4 image");
    let cat = space_testkit::run_within(
        std::process::Command::new("debugfs").args(["-R", "cat /hello.txt"]).arg(&image),
        space_testkit::PATIENCE,
    );
    assert_eq!(String::from_utf8_lossy(&cat.unwrap()), "added in layer 2\n");
    for id in [first, second] {
        server.delete_sandbox(&id);
    }
}

#[test]
fn the_same_image_as_an_oci_layout_gives_the_same_sandbox() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let archive = two_layer_image(&work_dir(&data, "oci"), ArchiveFormat::OciLayout);

    let operation = import(&server, "ocilayout", &archive);
    assert_eq!(operation["state"], "succeeded", "{operation}");
    let template = server.ok("GET", "/v1/templates/ocilayout", None);
    assert_eq!(template["source"]["oci"]["format"], "oci-layout", "{template}");
    let id = server.create_sandbox(json!({"template": "ocilayout"}));
    let seen = server.exec(&id, json!({"cmd": CHECK}));
    assert_eq!((seen["stdout"].as_str(), seen["result"]["exit_code"].as_i64()), (Some(EXPECTED), Some(0)), "{seen}");
    server.delete_sandbox(&id);

    // Request values win over the image's; a gzip-compressed upload works too.
    let gz = archive.with_extension("tar.gz");
    let mut encoder = flate2::write::GzEncoder::new(fs::File::create(&gz).unwrap(), Default::default());
    std::io::copy(&mut fs::File::open(&archive).unwrap(), &mut encoder).unwrap();
    encoder.finish().unwrap();
    let (status, accepted) =
        server.upload("/v1/templates?name=ocilayout&workdir=/etc&memory_mib=256", "application/gzip", &gz);
    assert_eq!(status, 202, "{accepted}");
    let operation = server.wait_operation(accepted["operation"]["id"].as_str().unwrap());
    assert_eq!(operation["state"], "succeeded", "{operation}");
    let template = server.ok("GET", "/v1/templates/ocilayout", None);
    assert_eq!((template["version"].as_u64(), template["defaults"]["workdir"].as_str()), (Some(2), Some("/etc")));
    assert_eq!(template["defaults"]["memory_mib"], 256);
    let id = server.create_sandbox(json!({"template": "ocilayout"}));
    assert_eq!(server.exec(&id, json!({"cmd": "pwd"}))["stdout"], "/etc\n");
    server.delete_sandbox(&id);
}

/// zstd-compressed layers (what newer builders push) import as gzip ones
/// do; a zstd layer whose bytes were changed after its digest was taken is
/// refused with nothing left behind (a frame asking for a huge window is
/// `space-host`'s unit test).
#[test]
fn zstd_layers_import_and_broken_ones_are_refused() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let archive = two_layer_image(&work_dir(&data, "zstd"), ArchiveFormat::OciLayoutZstd);
    let operation = import(&server, "zstdlayers", &archive);
    assert_eq!(operation["state"], "succeeded", "{operation}");
    let id = server.create_sandbox(json!({"template": "zstdlayers"}));
    let seen = server.exec(&id, json!({"cmd": CHECK}));
    assert_eq!((seen["stdout"].as_str(), seen["result"]["exit_code"].as_i64()), (Some(EXPECTED), Some(0)), "{seen}");
    server.delete_sandbox(&id);

    // One byte of the second layer's compressed stream changed.
    let tampered = two_layer_image(&work_dir(&data, "zstd-tampered"), ArchiveFormat::OciLayoutZstd);
    let mut bytes = fs::read(&tampered).unwrap();
    let zstd_at = bytes.windows(4).rposition(|w| w == [0x28, 0xb5, 0x2f, 0xfd]).expect("a zstd layer");
    bytes[zstd_at + 40] ^= 0xff;
    fs::write(&tampered, &bytes).unwrap();

    let templates_before = tree(&data.root().join("templates"));
    let operation = import(&server, "zstdbroken", &tampered);
    assert_eq!(operation["state"], "failed", "{operation}");
    let message = operation["error"]["message"].as_str().unwrap();
    assert!(message.contains("layer 2"), "{message}");
    assert_eq!(tree(&data.root().join("templates")), templates_before, "no half-built template is left");
}

/// A template root another node of a cluster sent (`import_pulled`, what
/// a pull does once the tar's SHA-256 matched): a good one becomes a
/// template sandboxes run on; one whose members climb out of the build dir
/// (a peer's bytes are no more trusted than a tenant's) fails in the
/// confined importer child, writes nothing outside and leaves no template.
#[test]
fn a_pulled_root_is_applied_by_the_importer_child_and_a_hostile_one_is_refused() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let dir = work_dir(&data, "pulled");
    let meta = |name: &str| {
        serde_json::from_value::<space_host::template::TemplateMeta>(json!({
            "name": name, "version": 1, "created_at": "2026-12-06T00:00:00Z", "source": {"pulled": true},
            "defaults": {"vcpus": 1, "memory_mib": 256, "disk_mib": 1024, "env": {"FROM": "peer"},
                         "workdir": "/", "user": "root"},
        }))
        .unwrap()
    };
    let good = base_layer(&dir).file("etc/peer.txt", 0o644, b"from a peer\n").finish();
    let info = server.platform.import_pulled(&meta("pulled"), fs::File::open(&good).unwrap()).unwrap();
    assert_eq!((info.meta.name.as_str(), info.meta.version), ("pulled", 1));
    let id = server.create_sandbox(json!({"template": "pulled"}));
    let seen = server.exec(&id, json!({"cmd": "cat /etc/peer.txt; echo $FROM"}));
    assert_eq!(seen["stdout"], "from a peer\npeer\n", "{seen}");
    server.delete_sandbox(&id);

    let marker = format!("space-pulled-escape-{}", std::process::id());
    let hostile =
        Layer::new(&dir, "hostile").raw(tar::EntryType::Regular, &format!("../../../{marker}"), "", b"out").finish();
    let templates_before = tree(&data.root().join("templates"));
    let err = server.platform.import_pulled(&meta("hostile"), fs::File::open(&hostile).unwrap()).unwrap_err();
    assert!(err.to_string().contains(".."), "{err}");
    assert_eq!(tree(&data.root().join("templates")), templates_before, "no half-built template is left");
    for place in [Path::new("/tmp"), Path::new("/"), data.root(), &data.root().join("templates")] {
        assert!(!place.join(&marker).exists(), "{} was written", place.join(&marker).display());
    }
}

/// Every file and directory name under `dir`, recursively (not following links).
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            found.push(entry.path());
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                found.extend(tree(&entry.path()));
            }
        }
    }
    found
}

#[test]
fn hostile_and_broken_archives_fail_cleanly_and_write_nothing_outside() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let dir = work_dir(&data, "hostile");
    let marker = format!("space-escape-{}", std::process::id());
    let settings = ImageSettings::default();
    let image = |name: &str, layer: Layer| {
        let out = dir.join(format!("{name}.image.tar"));
        write_archive(&out, ArchiveFormat::DockerSave, &[layer.finish()], &settings).unwrap();
        out
    };
    let garbage = dir.join("garbage.tar");
    fs::write(&garbage, (0..65536u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect::<Vec<_>>()).unwrap();
    let traversal = image(
        "traversal",
        Layer::new(&dir, "traversal").raw(tar::EntryType::Regular, &format!("../../../{marker}"), "", b"out"),
    );
    let absolute = image(
        "absolute",
        Layer::new(&dir, "absolute").raw(tar::EntryType::Regular, &format!("/tmp/{marker}"), "", b"out"),
    );
    let symlink_out =
        image("symlink", Layer::new(&dir, "symlink").symlink("escape", "../../../../../../tmp").dir("bin"));
    let hardlink_out = image(
        "hardlink",
        Layer::new(&dir, "hardlink").raw(tar::EntryType::Link, "passwd", "../../../../../../etc/passwd", b""),
    );
    // A layer whose bytes were changed after its digest was taken.
    let tampered = two_layer_image(&work_dir(&data, "tampered"), ArchiveFormat::OciLayout);
    let mut bytes = fs::read(&tampered).unwrap();
    let at = bytes.windows(16).position(|w| w == b"added in layer 2").map(|_| ());
    assert!(at.is_none(), "layer 2 is gzip-compressed in an OCI layout");
    let gzip_at = bytes.windows(3).rposition(|w| w == [0x1f, 0x8b, 0x08]).expect("a gzip layer");
    bytes[gzip_at + 40] ^= 0xff;
    fs::write(&tampered, &bytes).unwrap();

    let templates_before = tree(&data.root().join("templates"));
    for (archive, reason) in [
        (&garbage, "not a tar"),
        (&traversal, "`..`"),
        (&absolute, "absolute"),
        (&symlink_out, "outside the image root"),
        (&hardlink_out, "outside the image root"),
        (&tampered, "layer"),
    ] {
        let operation = import(&server, "hostile", archive);
        assert_eq!(operation["state"], "failed", "{}: {operation}", archive.display());
        assert_eq!(operation["error"]["code"], "build_failed");
        let message = operation["error"]["message"].as_str().unwrap();
        assert!(message.contains(reason), "{}: {message}", archive.display());
        server.error("GET", "/v1/templates/hostile", None, 404, "template_not_found");
        assert_eq!(tree(&data.root().join("templates")), templates_before, "no half-built template is left");
    }
    for place in [Path::new("/tmp"), Path::new("/"), data.root(), &data.root().join("templates")] {
        assert!(!place.join(&marker).exists(), "{} was written", place.join(&marker).display());
    }
    let uploads = data.root().join("run/uploads");
    assert_eq!(fs::read_dir(&uploads).map(|d| d.count()).unwrap_or(0), 0, "uploads are removed");

    // A symlink to an absolute path is the image's own business: writing
    // through it lands inside the root, never on the host.
    let inside = image(
        "inside",
        Layer::new(&dir, "inside").symlink("etc-link", "/etc").file(&format!("etc-link/{marker}"), 0o644, b"in"),
    );
    assert_eq!(import(&server, "inside", &inside)["state"], "succeeded");
    assert!(data.root().join(format!("templates/inside/1/rootfs/etc/{marker}")).is_file());
    assert!(!Path::new("/etc").join(&marker).exists(), "the host's /etc was written");

    // The request itself: a name is needed, and the body must be one of the two kinds.
    let auth = format!("Authorization: Bearer {}", server.key);
    for (query, content_type, expected) in [
        ("", "application/x-tar", "400 Bad Request"),
        ("?name=x", "text/plain", "415 Unsupported Media Type"),
        ("?name=Bad..Name", "application/x-tar", "400 Bad Request"),
        ("?name=x&bogus=1", "application/x-tar", "400 Bad Request"),
    ] {
        let head = format!("POST /v1/templates{query} HTTP/1.1\r\n{auth}\r\nContent-Type: {content_type}");
        let answer = server.early_answer(&head, b"not an archive");
        assert!(answer.starts_with(&format!("HTTP/1.1 {expected}")), "{query} {content_type}: {answer}");
    }
}

/// An image whose one layer is a file of `mib` MiB, uncompressed: reading
/// its digests and writing it keeps the importer at work long enough to be
/// seen from outside.
fn large_image(dir: &Path, mib: u64) -> PathBuf {
    let layer = dir.join("large.tar");
    {
        let mut tar = tar::Builder::new(fs::File::create(&layer).unwrap());
        let mut header = Layer::header(tar::EntryType::Regular, 0o644, mib << 20);
        tar.append_data(&mut header, "large", std::io::Read::take(std::io::repeat(7), mib << 20)).unwrap();
        tar.finish().unwrap();
    }
    let out = dir.join("large.image.tar");
    write_archive(&out, ArchiveFormat::DockerSave, std::slice::from_ref(&layer), &ImageSettings::default()).unwrap();
    fs::remove_file(layer).unwrap();
    out
}

/// Uploads an archive; the import operation's id.
fn start_import(server: &TestServer, name: &str, archive: &Path) -> String {
    let (status, accepted) = server.upload(&format!("/v1/templates?name={name}"), "application/x-tar", archive);
    assert_eq!(status, 202, "{accepted}");
    accepted["operation"]["id"].as_str().unwrap().to_string()
}

/// The importer child building into `data`'s templates, once it has
/// confined itself (its seccomp filter is the last step): its pid and
/// `/proc/PID/status`. `None` once `done` says the import ended first.
fn confined_importer(data: &TestDataDir, mut done: impl FnMut() -> bool) -> Option<(i32, String)> {
    let templates = data.root().join("templates").to_string_lossy().into_owned();
    space_testkit::wait_for("the importer child at work", Duration::from_secs(120), || {
        let found = fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            let ours = cmdline.contains(space_engine::templates::importer::SUBCOMMAND) && cmdline.contains(&templates);
            let status = fs::read_to_string(entry.path().join("status")).ok()?;
            (ours && status.lines().any(|l| l.split_whitespace().eq(["Seccomp:", "2"]))).then_some((pid, status))
        });
        match found {
            Some(found) => Some(Some(found)),
            None => done().then_some(None),
        }
    })
}

fn status_field<'a>(status: &'a str, name: &str) -> &'a str {
    status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).map(str::trim).unwrap_or("")
}

#[test]
fn the_importer_child_holds_only_what_extracting_needs_and_its_death_fails_the_build() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let archive = large_image(&work_dir(&data, "large"), 96);
    let ended = |operation: &str| {
        let seen = server.ok("GET", &format!("/v1/operations/{operation}"), None);
        matches!(seen["state"].as_str(), Some("succeeded" | "failed"))
    };

    // Seen from outside while it reads the archive: root, with only the
    // four file-owning capabilities in every set, no_new_privs, seccomp,
    // and the build dir as its root.
    let operation = start_import(&server, "large", &archive);
    let (pid, status) = confined_importer(&data, || ended(&operation)).expect("the importer child was never seen");
    let kept = "000000000000001b";
    for (field, want) in [
        ("Uid", "0\t0\t0\t0"),
        ("CapEff", kept),
        ("CapPrm", kept),
        ("CapBnd", kept),
        ("CapInh", "0000000000000000"),
        ("CapAmb", "0000000000000000"),
        ("NoNewPrivs", "1"),
        ("Seccomp", "2"),
    ] {
        assert_eq!(status_field(&status, field), want, "{field} of the importer: {status}");
    }
    let root = fs::read_link(format!("/proc/{pid}/root"));
    let build = data.root().join("templates/large/.1.partial");
    assert!(root.as_ref().is_ok_and(|r| *r == build) || ended(&operation), "its root is {root:?}, not {build:?}");
    assert_eq!(server.wait_operation(&operation)["state"], "succeeded");
    let rootfs = data.root().join("templates/large/1/rootfs");
    assert_eq!(fs::metadata(rootfs.join("large")).unwrap().len(), 96 << 20);
    assert!(rootfs.join(".space").is_dir(), "the parent installed the agent");
    assert!(!data.root().join("templates/large/1/work").exists(), "the work dir is removed");

    // Killed in the middle: a failed build that says so, nothing left.
    let templates_before = tree(&data.root().join("templates"));
    let operation = start_import(&server, "killed", &archive);
    let (pid, _) = confined_importer(&data, || ended(&operation)).expect("the second importer was never seen");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL).unwrap();
    let failed = server.wait_operation(&operation);
    assert_eq!((failed["state"].as_str(), failed["error"]["code"].as_str()), (Some("failed"), Some("build_failed")));
    let log = fs::read_to_string(data.root().join("logs").join(format!("{operation}.log"))).unwrap();
    assert!(log.contains("import failed: ") && log.contains("killed by signal 9"), "{log}");
    server.error("GET", "/v1/templates/killed", None, 404, "template_not_found");
    assert_eq!(tree(&data.root().join("templates")), templates_before, "no half-built template is left");
    server.stop();

    // No importer binary: the import fails saying so; nothing parses the
    // archive in the root process instead.
    let mut config = platform_config(&data);
    config.importer_bin = PathBuf::from("/nonexistent/space");
    let server = TestServer::start_with(config);
    let archive = two_layer_image(&work_dir(&data, "no-importer"), ArchiveFormat::DockerSave);
    let operation = start_import(&server, "orphan", &archive);
    assert_eq!(server.wait_operation(&operation)["state"], "failed");
    let log = fs::read_to_string(data.root().join("logs").join(format!("{operation}.log"))).unwrap();
    assert!(log.contains("starting the importer /nonexistent/space"), "{log}");
    server.error("GET", "/v1/templates/orphan", None, 404, "template_not_found");
    server.stop();

    // An importer that says it is confined but is not (root with every
    // capability): the parent reads its status, stops it and fails the
    // build before giving it the go-ahead to read.
    let liar = work_dir(&data, "liar").join("liar.sh");
    fs::write(&liar, "#!/bin/sh\necho '{\"report\":\"confined\",\"landlock\":\"Full\"}'\nexec sleep 30\n").unwrap();
    fs::set_permissions(&liar, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut config = platform_config(&data);
    config.importer_bin = liar;
    let server = TestServer::start_with(config);
    let operation = start_import(&server, "lied", &archive);
    assert_eq!(server.wait_operation(&operation)["state"], "failed");
    let log = fs::read_to_string(data.root().join("logs").join(format!("{operation}.log"))).unwrap();
    assert!(log.contains("the importer is not confined as it must be"), "{log}");
    server.error("GET", "/v1/templates/lied", None, 404, "template_not_found");
}

#[test]
fn a_template_can_ask_for_its_engine() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let archive = two_layer_image(&work_dir(&data, "engine"), ArchiveFormat::DockerSave);

    // Asking for the engine the server runs anyway: sandboxes run as usual.
    let (status, accepted) = server.upload("/v1/templates?name=ongvisor&engine=gvisor", "application/x-tar", &archive);
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(server.wait_operation(accepted["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    assert_eq!(server.ok("GET", "/v1/templates/ongvisor", None)["engine"], "gvisor");
    let id = server.create_sandbox(json!({"template": "ongvisor"}));
    assert_eq!(server.ok("GET", &format!("/v1/sandboxes/{id}"), None)["engine"], "gvisor");
    assert_eq!(server.exec(&id, json!({"cmd": "cat /hello.txt"}))["stdout"], "added in layer 2\n");
    server.delete_sandbox(&id);

    // A firecracker template on a host that makes no ext4 images would be
    // one no sandbox can start from: refused at once.
    if !server.platform.data().ext4_images() {
        // Refused before the body is read: written on a raw socket.
        let auth = format!("Authorization: Bearer {}", server.key);
        let head = format!(
            "POST /v1/templates?name=onfirecracker&engine=firecracker HTTP/1.1\r\n{auth}\r\nContent-Type: application/x-tar"
        );
        let refused = server.early_answer(&head, &std::fs::read(&archive).unwrap());
        assert!(refused.starts_with("HTTP/1.1 422") && refused.contains("ext4"), "{refused}");
    }
    // An engine this host cannot run (its image made all the same, as for
    // a cluster's other nodes): the create says so, and nothing is made.
    let server = {
        server.stop();
        let mut config = platform_config(&data);
        config.ext4_images = Some(true);
        TestServer::start_with(config)
    };
    let (status, accepted) =
        server.upload("/v1/templates?name=onfirecracker&engine=firecracker", "application/x-tar", &archive);
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(server.wait_operation(accepted["operation"]["id"].as_str().unwrap())["state"], "succeeded");
    if !space_host::hardware_virtualization() {
        let refused = server.error(
            "POST",
            "/v1/sandboxes",
            Some(json!({"template": "onfirecracker"})),
            503,
            "engine_unavailable",
        );
        let message = refused["error"]["message"].as_str().unwrap();
        assert!(message.contains("firecracker") && message.contains("cannot run"), "{message}");
        let listed = server.ok("GET", "/v1/sandboxes", None);
        assert!(listed["sandboxes"].as_array().unwrap().iter().all(|s| s["template"] != "onfirecracker"), "{listed}");
    }
    let auth = format!("Authorization: Bearer {}", server.key);
    let head = format!("POST /v1/templates?name=x&engine=qemu HTTP/1.1\r\n{auth}\r\nContent-Type: application/x-tar");
    assert!(server.early_answer(&head, b"x").starts_with("HTTP/1.1 422"));
}
