//! The data dir on a real loop-mounted btrfs image (needs root and
//! mkfs.btrfs, which `space setup` installs).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use space_host::datadir::{ensure_btrfs, DataDir};

const MIB: u64 = 1 << 20;

/// A small tmpfs mounted for the test, unmounted (with whatever is mounted
/// under it) when dropped.
struct SmallDisk {
    dir: PathBuf,
}

impl SmallDisk {
    fn mount(mib: u64) -> SmallDisk {
        let dir = std::env::temp_dir().join(format!("space-host-datadir-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(status.success(), "mounting a tmpfs on {}", dir.display());
        SmallDisk { dir }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-R").arg(&self.dir).status();
        let _ = fs::remove_dir(&self.dir);
    }
}

fn free_bytes(path: &Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(path).unwrap();
    s.blocks_available() * s.fragment_size()
}

#[test]
fn a_data_dir_on_a_sparse_image_reports_no_more_free_space_than_the_disk_under_it_has() {
    let disk = SmallDisk::mount(300);
    let data = disk.dir.join("data");
    // A 2 GiB sparse image on a 300 MiB disk: the btrfs alone claims far
    // more than it could ever write.
    let said = ensure_btrfs(&data, 2).unwrap();
    assert!(said.contains("sparse btrfs image"), "{said}");
    assert!(free_bytes(&data) > 1024 * MIB, "the btrfs itself says {} MiB free", free_bytes(&data) / MIB);

    let dir = DataDir::open(&data).unwrap();
    assert_eq!(dir.space().image_host(), Some(disk.dir.as_path()), "the image sits in the data dir, under its mount");
    let (free, total) = dir.disk_space();
    assert!(
        free <= free_bytes(&disk.dir),
        "{} MiB free reported over a {} MiB disk",
        free / MIB,
        free_bytes(&disk.dir) / MIB
    );
    assert!(free > 0, "the disk under the image is not full");
    assert!(total > 1024 * MIB, "total stays the btrfs's own: {} MiB", total / MIB);

    // What is written into the btrfs comes off the disk under it, and the
    // data dir's free space follows.
    let mut file = fs::File::create(data.join("fill")).unwrap();
    let chunk = vec![0x5a_u8; MIB as usize];
    for _ in 0..100 {
        file.write_all(&chunk).unwrap();
    }
    file.sync_all().unwrap();
    drop(file);
    let after = dir.disk_space().0;
    assert!(after + 90 * MIB <= free, "100 MiB written: {} MiB free before, {} MiB after", free / MIB, after / MIB);
    assert!(after <= free_bytes(&disk.dir));
}
