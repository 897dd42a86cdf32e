//! A tar stream out of a sandbox (what `space cp SANDBOX:/dir ./dir`
//! receives: the agent packs it, and whatever runs in the sandbox chooses
//! what is in it) unpacked on the client's host: nothing outside the target
//! may be created or changed, whatever the entries say, and nothing may panic.

#![no_main]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn base() -> &'static PathBuf {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| std::env::temp_dir().join(format!("space-fuzz-cp-{}", std::process::id())))
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

fuzz_target!(|data: &[u8]| {
    let a = base().join("a");
    let target = a.join("target");
    let outside = a.join("outside");
    let _ = fs::remove_dir_all(base());
    fs::create_dir_all(&target).unwrap();
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("sentinel"), b"untouched").unwrap();

    let _ = space_host::download::unpack_within(data, &target);

    assert_eq!(names(base()), ["a"], "something was written beside the base");
    assert_eq!(names(&a), ["outside", "target"], "something was written next to the target");
    assert_eq!(names(&outside), ["sentinel"]);
    assert_eq!(fs::read(outside.join("sentinel")).unwrap(), b"untouched");
    let _ = fs::remove_dir_all(base());
});
