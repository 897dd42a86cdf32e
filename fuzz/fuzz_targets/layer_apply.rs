//! An image layer (an uncompressed tar from a hostile image) applied into a
//! fresh root: whatever the entries say (`..`, absolute paths, symlinks to
//! `/` or out of the root, hard links, whiteouts), nothing outside the root
//! may be created or changed, and nothing may panic.

#![no_main]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

/// `<tmp>/space-fuzz-layer-<pid>/a/b/{root,outside}`: `..` from the root
/// lands in `b`, then `a`, which are checked too.
fn base() -> &'static PathBuf {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| std::env::temp_dir().join(format!("space-fuzz-layer-{}", std::process::id())))
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

fuzz_target!(|data: &[u8]| {
    let a = base().join("a");
    let b = a.join("b");
    let root = b.join("root");
    let outside = b.join("outside");
    let _ = fs::remove_dir_all(base());
    fs::create_dir_all(&root).unwrap();
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("sentinel"), b"untouched").unwrap();

    let _ = space_host::oci::apply_tar(&root, data, &mut std::io::sink(), &mut || {});

    assert_eq!(names(base()), ["a"], "something was written beside the base");
    assert_eq!(names(&a), ["b"], "something was written two levels up");
    assert_eq!(names(&b), ["outside", "root"], "something was written next to the root");
    assert_eq!(names(&outside), ["sentinel"]);
    assert_eq!(fs::read(outside.join("sentinel")).unwrap(), b"untouched");
    let _ = fs::remove_dir_all(base());
});
