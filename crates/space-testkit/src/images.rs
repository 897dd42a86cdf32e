//! An image for registry tests: a static busybox as its shell, a file a
//! later layer whites out, a directory a later layer makes opaque, and a
//! run config (env, working dir, start command), in a gzip layer and a
//! zstd one.

use serde_json::json;

use crate::oci_layout::{self, Compression, Image, Layer, Member, PushFormat, Written};
use crate::registry::{Registry, ScratchDir};

/// What `/etc/greeting` holds in [`app_image`] (its top layer's).
pub const GREETING: &str = "from the top layer";

pub fn app_image() -> Image {
    let busybox = std::fs::read(crate::busybox_static()).expect("the static busybox");
    let base = Layer::new(
        Compression::Gzip,
        vec![
            Member::dir("bin"),
            Member::File { path: "bin/busybox".into(), contents: busybox, mode: 0o755 },
            Member::Symlink { path: "bin/sh".into(), target: "busybox".into() },
            Member::Symlink { path: "bin/cat".into(), target: "busybox".into() },
            Member::dir("etc"),
            Member::file("etc/greeting", "from the base"),
            Member::file("etc/gone", "whited out above"),
            Member::dir("cache"),
            Member::file("cache/old", "hidden by an opaque dir"),
        ],
    );
    let top = Layer::new(
        Compression::Zstd,
        vec![
            Member::Whiteout { path: "etc/gone".into() },
            Member::Opaque { dir: "cache".into() },
            Member::file("cache/new", "kept"),
            Member::file("etc/greeting", GREETING),
            Member::dir("app"),
            Member::file("app/run.sh", "echo running"),
        ],
    );
    let mut image = Image::amd64(vec![base, top]);
    image.run_config = json!({
        "Env": ["PATH=/bin", "GREETING=hello from the config"],
        "WorkingDir": "/app",
        "Entrypoint": ["/bin/sh"],
        "Cmd": ["run.sh"],
    });
    image
}

/// Writes [`app_image`] and pushes it to `registry` as `repo:tag` (with
/// `creds` when the registry wants them); what was written.
pub fn push_app_image(registry: &Registry, repo: &str, tag: &str, creds: Option<(&str, &str)>) -> Written {
    let layout = ScratchDir::new("app-layout");
    let written = oci_layout::write(&layout, tag, &[app_image()]);
    oci_layout::push(&layout, tag, &registry.host, repo, creds, PushFormat::Oci);
    written
}
