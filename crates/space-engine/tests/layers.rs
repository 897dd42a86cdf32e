//! The layer chain cache on a real btrfs data dir, with the real confined
//! importer: applied in process ([`LocalTemplates`]) and through the
//! helper's socket ([`HelperHost`] to a served `LocalTemplates`), every
//! case the same. A chain is applied once and then a hit without its blob
//! being read; whiteouts and opaque directories act across chains; a
//! template made of a chain shares it and outlives its deletion; a layer
//! that climbs out of its root, lies about its digest or names a parent
//! that is not there leaves nothing behind. Needs root, like the engine.

use std::fs;
use std::io::{Seek, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use space_engine::helper::{serve_engines, Engines, HelperHost};
use space_engine::templates::{invalid_input, BuildInput, LayerReady, LocalTemplates, TemplateHost};
use space_privsep::layout::Layout;
use space_privsep::peer::HelperListener;
use space_privsep::proto::{
    BlobDigest, ChainId, DiskMib, LayerKey, StepKey, TemplateName, TemplateRef, TemplateVersion,
};
use space_testkit::{agent_bin, space_bin, TestDataDir};

const DEADLINE: Duration = Duration::from_secs(120);

/// One tar member of a layer the test writes.
enum Entry<'a> {
    File(&'a str, &'a str),
    Dir(&'a str),
    Symlink(&'a str, &'a str),
}

fn layer_tar(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        match entry {
            Entry::File(path, text) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(text.len() as u64);
                header.set_mode(0o644);
                // Written raw: the tar crate refuses to write a `..` name,
                // and a hostile layer is made of just such names.
                header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
                header.set_cksum();
                builder.append(&header, text.as_bytes()).unwrap();
            }
            Entry::Dir(path) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                header.set_mode(0o755);
                builder.append_data(&mut header, path, std::io::empty()).unwrap();
            }
            Entry::Symlink(path, target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_size(0);
                header.set_mode(0o777);
                builder.append_link(&mut header, path, target).unwrap();
            }
        }
    }
    builder.into_inner().unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(bytes, 3).unwrap()
}

fn digest(bytes: &[u8]) -> BlobDigest {
    let hex: String = Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
    BlobDigest::parse(&format!("sha256:{hex}")).unwrap()
}

/// A blob as the cache is handed one: an open file.
fn blob_file(bytes: &[u8]) -> fs::File {
    let mut file = tempfile_in_tmp();
    file.write_all(bytes).unwrap();
    file.rewind().unwrap();
    file
}

fn tempfile_in_tmp() -> fs::File {
    let mut name = [0u8; 8];
    getrandom::getrandom(&mut name).unwrap();
    let path = std::env::temp_dir()
        .join(format!("space-layer-{}", name.iter().map(|b| format!("{b:02x}")).collect::<String>()));
    let file = fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
    fs::remove_file(&path).unwrap();
    file
}

fn log_file() -> fs::File {
    tempfile_in_tmp()
}

/// A blob layer of `bytes` (its digest and diff_id computed here).
fn blob_key(blob: &[u8], tar: &[u8]) -> LayerKey {
    LayerKey::Blob { digest: digest(blob), diff_id: Some(digest(tar)) }
}

fn read(root: &Path, path: &str) -> Option<String> {
    fs::read_to_string(root.join(path)).ok()
}

fn disk() -> DiskMib {
    DiskMib::new(256).unwrap()
}

fn apply(host: &dyn TemplateHost, parent: Option<&ChainId>, key: &LayerKey, blob: &[u8]) -> LayerReady {
    host.apply_layer(parent, key, disk(), blob_file(blob), log_file(), &mut |_| {})
        .unwrap_or_else(|err| panic!("applying {key:?}: {err}"))
}

fn refused(host: &dyn TemplateHost, parent: Option<&ChainId>, key: &LayerKey, blob: &[u8]) -> String {
    let log = log_file();
    match host.apply_layer(parent, key, disk(), blob_file(blob), log.try_clone().unwrap(), &mut |_| {}) {
        Ok(ready) => {
            let mut said = String::new();
            let mut log = log;
            log.rewind().unwrap();
            std::io::Read::read_to_string(&mut log, &mut said).unwrap();
            panic!("applied {key:?} as {} ({ready:?}); its log: {said}", ready.chain)
        }
        Err(err) => invalid_input(&err).map(str::to_string).unwrap_or_else(|| format!("not the input's fault: {err}")),
    }
}

/// No chain build dir is left in the cache.
fn no_partials(layout: &Layout) {
    let left: Vec<String> = fs::read_dir(layout.layer_cache())
        .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(left.iter().all(|name| !name.ends_with(".partial")), "left: {left:?}");
}

fn exercise(host: &dyn TemplateHost, layout: &Layout, template_name: &str) {
    // Layer 1 (gzip): a file, a directory of two, one to be whited out.
    let tar1 = layer_tar(&[
        Entry::Dir("etc"),
        Entry::File("etc/hello", "one"),
        Entry::Dir("dir"),
        Entry::File("dir/a", "a"),
        Entry::File("dir/b", "b"),
        Entry::File("gone", "soon"),
    ]);
    let blob1 = gzip(&tar1);
    let key1 = blob_key(&blob1, &tar1);
    let first = apply(host, None, &key1, &blob1);
    assert!(!first.cached);
    assert_eq!(first.chain, ChainId::next(None, &key1));
    assert_eq!(first.bytes, blob1.len() as u64);
    assert!(host.has_layer(&first.chain).unwrap());
    let root1 = layout.layer_root(&first.chain);
    assert_eq!(read(&root1, "etc/hello").as_deref(), Some("one"));
    assert!(fs::write(root1.join("etc/hello"), "changed").is_err(), "a chain is read-only");

    // Again: a hit, its blob never read (this one is not even a layer).
    let again = apply(host, None, &key1, b"not read");
    assert!(again.cached && again.chain == first.chain && again.bytes == 0);

    // Layer 2 (zstd) on it: a whiteout, an opaque directory, a change.
    let tar2 = layer_tar(&[
        Entry::File(".wh.gone", ""),
        Entry::Dir("dir"),
        Entry::File("dir/.wh..wh..opq", ""),
        Entry::File("dir/c", "c"),
        Entry::File("etc/hello", "two"),
    ]);
    let blob2 = zstd(&tar2);
    let key2 = blob_key(&blob2, &tar2);
    let second = apply(host, Some(&first.chain), &key2, &blob2);
    let root2 = layout.layer_root(&second.chain);
    assert_eq!(read(&root2, "etc/hello").as_deref(), Some("two"));
    assert!(!root2.join("gone").exists() && !root2.join("dir/a").exists() && !root2.join("dir/b").exists());
    assert_eq!(read(&root2, "dir/c").as_deref(), Some("c"));
    // The chain below is untouched.
    assert_eq!(read(&root1, "gone").as_deref(), Some("soon"));
    assert_eq!(read(&root1, "etc/hello").as_deref(), Some("one"));

    // A build step's layer (a plain tar, no digest) on top.
    let tar3 = layer_tar(&[Entry::File("step", "made by a step")]);
    let key3 = LayerKey::Step { key: StepKey::parse(&"3".repeat(64)).unwrap() };
    let third = apply(host, Some(&second.chain), &key3, &tar3);
    assert_eq!(read(&layout.layer_root(&third.chain), "step").as_deref(), Some("made by a step"));

    // A template of the top chain: its files, and the agent.
    let template =
        TemplateRef { name: TemplateName::parse(template_name).unwrap(), version: TemplateVersion::new(1).unwrap() };
    host.build_template(&template, BuildInput::Layers { top: third.chain.clone() }, disk(), log_file(), &mut |_| {})
        .unwrap_or_else(|err| panic!("building a template of chain {}: {err}", third.chain));
    let built = layout.template_partial(&template).join("rootfs");
    assert_eq!(read(&built, "dir/c").as_deref(), Some("c"));
    assert_eq!(read(&built, "step").as_deref(), Some("made by a step"));
    assert!(built.join(space_host::template::AGENT_PATH_IN_ROOT).is_file(), "the agent is in");

    // Deleting the chains leaves the template whole (its root is a
    // snapshot of its own) and the chains gone.
    for chain in [&first.chain, &second.chain, &third.chain] {
        host.delete_layer(chain).unwrap();
        assert!(!host.has_layer(chain).unwrap());
    }
    assert_eq!(read(&built, "etc/hello").as_deref(), Some("two"));
    let missing = host.build_template(
        &TemplateRef { version: TemplateVersion::new(2).unwrap(), ..template.clone() },
        BuildInput::Layers { top: third.chain.clone() },
        disk(),
        log_file(),
        &mut |_| {},
    );
    assert!(missing.is_err(), "a template of a chain that is gone");
    host.delete_template(&template.name, None).unwrap();

    // Bad layers: each refused as the input's fault, nothing left.
    let escape = layer_tar(&[Entry::File("../escaped", "out")]);
    let why = refused(host, None, &blob_key(&escape, &escape), &escape);
    assert!(why.contains("escaped") || why.contains(".."), "{why}");
    let link_up = layer_tar(&[Entry::Symlink("up", "../../.."), Entry::File("x", "x")]);
    let why = refused(host, None, &blob_key(&link_up, &link_up), &link_up);
    assert!(why.contains("points outside the image root"), "{why}");
    // An absolute link is the image's own root, as in any container: what
    // is written through it lands inside the chain, never on the host.
    let marker = format!("space-layer-escape-{}", std::process::id());
    let through_root = format!("up/tmp/{marker}");
    let through_link = layer_tar(&[Entry::Symlink("up", "/"), Entry::File(&through_root, "in")]);
    let inside = apply(host, None, &blob_key(&through_link, &through_link), &through_link);
    assert_eq!(read(&layout.layer_root(&inside.chain), &format!("tmp/{marker}")).as_deref(), Some("in"));
    assert!(!Path::new("/tmp").join(&marker).exists());
    host.delete_layer(&inside.chain).unwrap();
    let honest = gzip(&layer_tar(&[Entry::File("x", "x")]));
    let lying = LayerKey::Blob { digest: digest(b"something else"), diff_id: None };
    let why = refused(host, None, &lying, &honest);
    assert!(why.contains("does not match its digest"), "{why}");
    let wrong_diff = LayerKey::Blob { digest: digest(&honest), diff_id: Some(digest(b"another tar")) };
    let why = refused(host, None, &wrong_diff, &honest);
    assert!(why.contains("diff_id"), "{why}");
    for key in [&lying, &wrong_diff] {
        assert!(!host.has_layer(&ChainId::next(None, key)).unwrap());
    }
    // A parent that is not there is not the layer's fault, but refused all the same.
    let orphan = host.apply_layer(Some(&third.chain), &key1, disk(), blob_file(&blob1), log_file(), &mut |_| {});
    let err = orphan.expect_err("a layer on a missing parent");
    assert!(err.to_string().contains("not in the cache"), "{err}");
    no_partials(layout);
}

#[test]
fn chains_apply_once_share_their_roots_and_refuse_bad_layers_in_process() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let host = LocalTemplates::new(layout.clone(), agent_bin()).with_importer(space_bin());
    exercise(&host, &layout, "layers-local");
}

#[test]
fn chains_apply_once_share_their_roots_and_refuse_bad_layers_through_the_helper() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let templates: Arc<dyn TemplateHost> =
        Arc::new(LocalTemplates::new(layout.clone(), agent_bin()).with_importer(space_bin()));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let socket = data.root().join("layers-helper.sock");
    let me = nix::unistd::geteuid().as_raw();
    let listener = runtime.block_on(async { HelperListener::bind(&socket, me) }).unwrap();
    runtime.spawn(serve_engines(listener, Engines { gvisor: None, firecracker: None }, Some(templates)));
    let client = HelperHost::with_patience(&socket, me, DEADLINE);
    exercise(&client, &layout, "layers-helper");
    runtime.shutdown_timeout(DEADLINE);
}
