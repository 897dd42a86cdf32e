//! Volumes on the real thing (issue 37, decision 031): btrfs subvolumes
//! under quota limits, made, snapshotted, restored and removed in process
//! and through the real helper; their files served by the confined files
//! child over the agent's protocol; bound into gVisor sandboxes read-write
//! and read-only, with the quota and links resolved in the sandbox's view.

use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{run, sh};
use space_engine::gvisor::{Gvisor, GvisorConfig};
use space_engine::helper::{serve_all, Engines, HelperHost};
use space_engine::volumes::{LocalVolumes, VolumeHost};
use space_engine::{AgentConn, Engine, FileRead, SandboxSpec, VolumeMountSpec};
use space_host::template::BASE_TEMPLATE;
use space_privsep::layout::Layout;
use space_privsep::peer::HelperListener;
use space_privsep::proto::{DiskMib, SnapshotName, VolumeId};
use space_testkit::{agent_bin, space_bin, TestDataDir};

const PATIENCE: Duration = Duration::from_secs(60);

/// A volume id unique to this test process and `tag`.
fn new_volume(tag: u8) -> VolumeId {
    VolumeId::parse(&format!("vol_{:012x}{tag:08x}", std::process::id())).unwrap()
}

fn snapshot(name: &str) -> SnapshotName {
    SnapshotName::parse(name).unwrap()
}

fn mib(n: u32) -> DiskMib {
    DiskMib::new(n).unwrap()
}

/// Create, usage, snapshot, restore, a volume from a snapshot, deletes:
/// what the platform asks of either host.
fn lifecycle(host: &dyn VolumeHost, layout: &Layout, data: &TestDataDir, tag: u8) {
    let volume = new_volume(tag);
    let files = layout.volume_data(&volume);
    host.create_volume(&volume, mib(64), None).unwrap();
    assert!(space_host::btrfs::is_subvolume(&files), "a subvolume of its own");
    let again = host.create_volume(&volume, mib(64), None).expect_err("a volume is made once");
    assert!(again.to_string().contains("exists"), "{again}");

    std::fs::write(files.join("notes.txt"), "first").unwrap();
    std::fs::write(files.join("blob"), vec![7u8; 2 << 20]).unwrap();
    data.sync();
    let usage = host.volume_usage(&volume).unwrap();
    assert!(usage.used_bytes >= 2 << 20, "its files are counted: {usage:?}");

    host.snapshot_volume(&volume, &snapshot("one")).unwrap();
    let kept = layout.volume_snapshot(&volume, &snapshot("one"));
    let write = std::fs::write(kept.join("notes.txt"), "changed");
    assert_eq!(write.err().and_then(|e| e.raw_os_error()), Some(nix::libc::EROFS), "a snapshot is read-only");
    assert!(host.snapshot_volume(&volume, &snapshot("one")).is_err(), "a snapshot's name is taken once");

    std::fs::write(files.join("notes.txt"), "second").unwrap();
    std::fs::write(files.join("added"), "after the snapshot").unwrap();
    host.restore_volume(&volume, &snapshot("one")).unwrap();
    assert_eq!(std::fs::read_to_string(files.join("notes.txt")).unwrap(), "first");
    assert!(!files.join("added").exists(), "the restore is the snapshot, whole");
    assert!(!layout.volume_data_new(&volume).exists() && !layout.volume_data_old(&volume).exists());
    std::fs::write(files.join("notes.txt"), "writable again").unwrap();
    let missing = host.restore_volume(&volume, &snapshot("nope")).expect_err("no such snapshot");
    assert!(missing.to_string().contains("no snapshot"), "{missing}");

    let copy = new_volume(tag + 1);
    host.create_volume(&copy, mib(16), Some((&volume, &snapshot("one")))).unwrap();
    assert_eq!(std::fs::read_to_string(layout.volume_data(&copy).join("notes.txt")).unwrap(), "first");
    let no_source = host.create_volume(&new_volume(tag + 2), mib(16), Some((&volume, &snapshot("nope"))));
    assert!(no_source.is_err() && !layout.volume_dir(&new_volume(tag + 2)).exists(), "nothing of it stays");

    let listed = host.list_volumes().unwrap();
    let ours: Vec<_> = listed.iter().filter(|v| v.volume == volume || v.volume == copy).collect();
    assert_eq!(ours.len(), 2, "{listed:?}");
    assert_eq!(ours.iter().find(|v| v.volume == volume).unwrap().snapshots, [snapshot("one")]);

    host.delete_volume_snapshot(&volume, &snapshot("one")).unwrap();
    host.delete_volume_snapshot(&volume, &snapshot("one")).unwrap();
    assert!(!kept.exists());
    host.delete_volume(&volume).unwrap();
    host.delete_volume(&copy).unwrap();
    host.delete_volume(&copy).unwrap();
    assert!(!layout.volume_dir(&volume).exists() && !layout.volume_dir(&copy).exists());
    assert!(host.volume_usage(&volume).is_err(), "a deleted volume is not there");
}

#[test]
fn a_volume_is_made_snapshotted_restored_and_deleted_in_process() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    lifecycle(&LocalVolumes::new(layout.clone(), space_bin()), &layout, &data, 1);
}

/// The helper and a host asking it, on a socket of the data dir.
struct Helper {
    runtime: tokio::runtime::Runtime,
    client: HelperHost,
}

fn helper(data: &TestDataDir, layout: &Layout) -> Helper {
    let volumes: Arc<dyn VolumeHost> = Arc::new(LocalVolumes::new(layout.clone(), space_bin()));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let socket = data.root().join("volumes-helper.sock");
    let me = nix::unistd::geteuid().as_raw();
    let listener = runtime.block_on(async { HelperListener::bind(&socket, me) }).unwrap();
    runtime.spawn(serve_all(listener, Engines::default(), None, Some(volumes)));
    Helper { runtime, client: HelperHost::with_patience(&socket, me, PATIENCE) }
}

#[test]
fn a_volume_is_made_snapshotted_restored_and_deleted_through_the_helper() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let Helper { runtime, client } = helper(&data, &layout);
    lifecycle(&client, &layout, &data, 11);
    runtime.shutdown_timeout(PATIENCE);
}

/// An ext4 image mounted on the host through a loop device (as root),
/// unmounted when dropped.
struct LoopMount(std::path::PathBuf);

impl LoopMount {
    fn new(image: &std::path::Path, at: &std::path::Path) -> LoopMount {
        std::fs::create_dir_all(at).unwrap();
        let mut mount = std::process::Command::new("mount");
        space_host::run(mount.args(["-o", "loop,nosuid,nodev"]).arg(image).arg(at)).expect("mount -o loop");
        LoopMount(at.to_path_buf())
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        let _ = space_host::run(std::process::Command::new("umount").arg(&self.0));
    }
}

/// A Firecracker node's volume (decision 031): its subvolume holds an ext4
/// image of exactly its size, sparse, root's alone; inside, the size is
/// the limit (ENOSPC); snapshots, a restore and a volume from a snapshot
/// carry the image as they carry any file.
fn image_lifecycle(host: &dyn VolumeHost, layout: &Layout, data: &TestDataDir, tag: u8) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let volume = new_volume(tag);
    host.create_image_volume(&volume, mib(32)).unwrap();
    let image = layout.volume_image(&volume);
    let meta = std::fs::metadata(&image).unwrap();
    assert_eq!(meta.len(), 32 << 20, "exactly its size");
    assert!(meta.blocks() * 512 < 8 << 20, "sparse: {} bytes on disk", meta.blocks() * 512);
    assert_eq!((meta.uid(), meta.permissions().mode() & 0o777), (0, 0o600), "root's alone");
    space_host::run(std::process::Command::new("e2fsck").arg("-fn").arg(&image)).expect("a clean file system");
    assert!(space_host::btrfs::is_subvolume(&layout.volume_data(&volume)));
    let again = host.create_image_volume(&volume, mib(32)).expect_err("a volume is made once");
    assert!(again.to_string().contains("exists"), "{again}");

    let inside = data.root().join(format!("inside-{tag}"));
    {
        let _mounted = LoopMount::new(&image, &inside);
        let root = std::fs::metadata(&inside).unwrap();
        assert_eq!((root.uid(), root.gid(), root.permissions().mode() & 0o777), (0, 0, 0o755));
        std::fs::write(inside.join("notes.txt"), "first").unwrap();
        // The size is the limit: a write past it is ENOSPC (no blocks are
        // kept back for root).
        let full = std::fs::write(inside.join("big"), vec![1u8; 40 << 20]);
        assert_eq!(full.err().and_then(|e| e.raw_os_error()), Some(nix::libc::ENOSPC), "past the size");
        std::fs::remove_file(inside.join("big")).unwrap();
    }
    data.sync();
    host.snapshot_volume(&volume, &snapshot("one")).unwrap();
    assert!(layout.volume_snapshot(&volume, &snapshot("one")).join("disk.ext4").is_file(), "the image goes with it");
    {
        let _mounted = LoopMount::new(&image, &inside);
        std::fs::write(inside.join("notes.txt"), "second").unwrap();
    }
    host.restore_volume(&volume, &snapshot("one")).unwrap();
    {
        let _mounted = LoopMount::new(&layout.volume_image(&volume), &inside);
        assert_eq!(std::fs::read_to_string(inside.join("notes.txt")).unwrap(), "first", "restored");
    }
    let copy = new_volume(tag + 1);
    host.create_volume(&copy, mib(32), Some((&volume, &snapshot("one")))).unwrap();
    {
        let _mounted = LoopMount::new(&layout.volume_image(&copy), &inside);
        assert_eq!(std::fs::read_to_string(inside.join("notes.txt")).unwrap(), "first", "a copy is an image too");
    }
    host.delete_volume(&volume).unwrap();
    host.delete_volume(&copy).unwrap();
    assert!(!layout.volume_dir(&volume).exists() && !layout.volume_dir(&copy).exists());
}

#[test]
fn an_image_volume_is_made_snapshotted_restored_and_deleted_in_process() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    image_lifecycle(&LocalVolumes::new(layout.clone(), space_bin()), &layout, &data, 31);
}

#[test]
fn an_image_volume_is_made_through_the_helper() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let Helper { runtime, client } = helper(&data, &layout);
    image_lifecycle(&client, &layout, &data, 41);
    runtime.shutdown_timeout(PATIENCE);
}

/// A restore killed between its renames (the old data moved aside, the
/// new not yet in) is finished by the next request on the volume; one
/// killed before its swap leaves the old data, its copy removed.
#[test]
fn a_restore_killed_half_way_is_finished_by_the_next_request() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let host = LocalVolumes::new(layout.clone(), space_bin());
    let volume = new_volume(21);
    let (files, new, old) =
        (layout.volume_data(&volume), layout.volume_data_new(&volume), layout.volume_data_old(&volume));
    host.create_volume(&volume, mib(16), None).unwrap();
    std::fs::write(files.join("state"), "snapshotted").unwrap();
    host.snapshot_volume(&volume, &snapshot("s")).unwrap();
    std::fs::write(files.join("state"), "current").unwrap();
    let kept = layout.volume_snapshot(&volume, &snapshot("s"));

    // Killed between the renames: `data` moved aside, `data.new` made.
    space_host::btrfs::snapshot(&kept, &new).unwrap();
    std::fs::rename(&files, &old).unwrap();
    assert!(!files.exists());
    host.volume_usage(&volume).unwrap();
    assert_eq!(std::fs::read_to_string(files.join("state")).unwrap(), "snapshotted", "the new data is in");
    assert!(!new.exists() && !old.exists(), "nothing of the swap is left");

    // Killed before the swap: only the copy was made.
    std::fs::write(files.join("state"), "current").unwrap();
    space_host::btrfs::snapshot(&kept, &new).unwrap();
    host.snapshot_volume(&volume, &snapshot("t")).unwrap();
    assert_eq!(std::fs::read_to_string(files.join("state")).unwrap(), "current", "the old data stays");
    assert!(!new.exists(), "the unused copy is gone");
    assert_eq!(
        std::fs::read_to_string(layout.volume_snapshot(&volume, &snapshot("t")).join("state")).unwrap(),
        "current"
    );
    host.delete_volume(&volume).unwrap();
}

fn welcome(volume: &VolumeId) -> space_proto::Welcome {
    space_proto::Welcome::plain(volume.to_string(), "volume", 1)
}

async fn read_all(agent: &AgentConn, path: &str) -> Result<Vec<u8>, space_engine::AgentError> {
    match agent.read_file(path, false).await? {
        FileRead::File { mut data, .. } => {
            let mut bytes = Vec::new();
            while let Some(chunk) = data.next_chunk().await? {
                bytes.extend(chunk);
            }
            Ok(bytes)
        }
        FileRead::Dir(listing) => panic!("{path} is a directory: {listing:?}"),
    }
}

async fn write_all(agent: &AgentConn, path: &str, bytes: &[u8]) -> Result<(), space_engine::AgentError> {
    let upload = agent.write_file(path, 0o644, false).await?;
    upload.send(bytes.to_vec()).await?;
    upload.finish().await
}

fn not_found(result: Result<Vec<u8>, space_engine::AgentError>, what: &str) {
    match result {
        Err(space_engine::AgentError::File(error)) => {
            assert_eq!(error.reason, space_proto::FileFailure::NotFound, "{what}: {}", error.message)
        }
        Err(other) => panic!("{what}: {other}"),
        Ok(bytes) => panic!("{what} was read: {:?}", String::from_utf8_lossy(&bytes)),
    }
}

/// What the server does with a volume's files: the socket `volume_files`
/// answers, a handshake as with an agent, then the agent's file calls.
/// Links in the volume resolve inside it, never on the host.
async fn files_through_the_child(host: &dyn VolumeHost, layout: &Layout, data: &TestDataDir, tag: u8) {
    let volume = new_volume(tag);
    host.create_volume(&volume, mib(32), None).unwrap();
    let files = layout.volume_data(&volume);
    // What only the host has: beside the volume's data, and in the data dir.
    std::fs::write(data.root().join("host-only"), "host secret").unwrap();
    let host_only = data.root().join("host-only").to_string_lossy().into_owned();
    std::os::unix::fs::symlink("/", files.join("link-root")).unwrap();
    std::os::unix::fs::symlink("..", files.join("link-up")).unwrap();
    std::os::unix::fs::symlink("/proc/1/root", files.join("link-proc")).unwrap();
    std::os::unix::fs::symlink(&host_only, files.join("link-host")).unwrap();

    let socket = host.volume_files(&volume, true).unwrap();
    socket.set_nonblocking(true).unwrap();
    let socket = tokio::net::UnixStream::from_std(socket).unwrap();
    let agent = AgentConn::handshake(socket, welcome(&volume), PATIENCE).await.expect("the child greets as an agent");

    write_all(&agent, "/work/notes.txt", b"from the files routes").await.unwrap();
    assert_eq!(std::fs::read_to_string(files.join("work/notes.txt")).unwrap(), "from the files routes");
    assert_eq!(read_all(&agent, "/work/notes.txt").await.unwrap(), b"from the files routes");
    write_all(&agent, "/work/notes.txt", b"replaced").await.unwrap();
    assert_eq!(read_all(&agent, "/work/notes.txt").await.unwrap(), b"replaced");
    let FileRead::Dir(listing) = agent.read_file("/", false).await.unwrap() else { panic!("/ is a directory") };
    let names: Vec<&str> = listing.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["link-host", "link-proc", "link-root", "link-up", "work"], "the volume is its root");

    // Every way out leads back into the volume.
    assert_eq!(read_all(&agent, "/link-root/work/notes.txt").await.unwrap(), b"replaced");
    assert_eq!(read_all(&agent, "/link-up/work/notes.txt").await.unwrap(), b"replaced");
    assert_eq!(read_all(&agent, "/../../work/notes.txt").await.unwrap(), b"replaced");
    not_found(read_all(&agent, "/link-host").await, "a link to a host file");
    not_found(read_all(&agent, &format!("/link-root{host_only}")).await, "a host file through a link to /");
    not_found(read_all(&agent, &format!("/link-up/../..{host_only}")).await, "a host file through ..");
    not_found(read_all(&agent, "/link-up/limit-mib").await, "the volume's own record beside its data");
    not_found(read_all(&agent, "/link-proc/etc/hostname").await, "the host's /proc/1/root");
    not_found(read_all(&agent, "/proc/self/status").await, "a /proc");
    // A write through a link lands in the volume, never on the host.
    write_all(&agent, "/link-root/written-through", b"inside").await.unwrap();
    assert_eq!(std::fs::read_to_string(files.join("written-through")).unwrap(), "inside");

    // A tar up into a directory, and the directory down as a tar.
    let mut archive = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(5);
    header.set_mode(0o640);
    header.set_cksum();
    archive.append_data(&mut header, "sub/hello.txt", &b"hello"[..]).unwrap();
    let archive = archive.into_inner().unwrap();
    let upload = agent.write_file("/unpacked", 0o755, true).await.unwrap();
    upload.send(archive).await.unwrap();
    upload.finish().await.unwrap();
    assert_eq!(std::fs::read_to_string(files.join("unpacked/sub/hello.txt")).unwrap(), "hello");
    let FileRead::File { data: mut tar_stream, .. } = agent.read_file("/unpacked", true).await.unwrap() else {
        panic!("a tar of a directory")
    };
    let mut tarred = Vec::new();
    while let Some(chunk) = tar_stream.next_chunk().await.unwrap() {
        tarred.extend(chunk);
    }
    let names: Vec<String> = tar::Archive::new(&tarred[..])
        .entries()
        .unwrap()
        .map(|entry| entry.unwrap().path().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().any(|name| name.ends_with("sub/hello.txt")), "{names:?}");
    // An archive that climbs out is refused whole.
    let mut bad = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Symlink);
    header.set_size(0);
    header.set_link_name(&host_only).unwrap();
    header.set_cksum();
    bad.append_data(&mut header, "escape", &b""[..]).unwrap();
    let mut header = tar::Header::new_gnu();
    header.set_size(1);
    header.set_mode(0o644);
    header.set_cksum();
    bad.append_data(&mut header, "escape/x", &b"x"[..]).unwrap();
    let upload = agent.write_file("/bad", 0o755, true).await.unwrap();
    upload.send(bad.into_inner().unwrap()).await.unwrap();
    assert!(upload.finish().await.is_err(), "an entry through a link out is refused");
    assert_eq!(std::fs::read_to_string(data.root().join("host-only")).unwrap(), "host secret");

    agent.delete_path("/work", true).await.unwrap();
    assert!(!files.join("work").exists());
    assert_eq!(std::fs::read_to_string(data.root().join("host-only")).unwrap(), "host secret");
    agent.hang_up();
    agent.closed().await;
    // The child ends once its socket is closed.
    let path = files.to_string_lossy().into_owned();
    space_testkit::wait_until("the files child ends", PATIENCE, || space_testkit::processes_mentioning(&path) == 0);
    host.delete_volume(&volume).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_volumes_files_are_served_by_its_confined_child_in_process() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let host = LocalVolumes::new(layout.clone(), space_bin());
    files_through_the_child(&host, &layout, &data, 31).await;
}

#[test]
fn a_volumes_files_are_served_by_its_confined_child_through_the_helper() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let Helper { runtime, client } = helper(&data, &layout);
    let test = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    test.block_on(files_through_the_child(&client, &layout, &data, 41));
    runtime.shutdown_timeout(PATIENCE);
}

// ---------------------------------------------------------------------------
// In gVisor sandboxes.

fn engine(data: &TestDataDir) -> Gvisor {
    Gvisor::new(GvisorConfig {
        runsc: "runsc".into(),
        agent_bin: agent_bin(),
        state_dir: data.data.run_dir().join("runsc"),
    })
}

fn sandbox(data: &TestDataDir, tag: u8, volumes: Vec<VolumeMountSpec>) -> SandboxSpec {
    let id = format!("sbx_{:012x}{tag:08x}", std::process::id());
    SandboxSpec {
        dir: data.data.sandbox_dir(&id),
        template_rootfs: data.data.template(BASE_TEMPLATE).unwrap().rootfs(),
        hostname: id.clone(),
        id,
        vcpus: 1,
        memory_mib: 256,
        disk_mib: 1024,
        volumes,
        ..Default::default()
    }
}

fn mount(volume: &VolumeId, path: &str, read_only: bool) -> VolumeMountSpec {
    VolumeMountSpec { volume: volume.to_string(), path: path.into(), read_only }
}

/// A sandbox writes to its read-write mount; another reads it read-only
/// (EROFS on a write); a write past the size is EDQUOT inside; links in
/// the volume resolve in the sandbox's own view.
#[tokio::test(flavor = "multi_thread")]
async fn sandboxes_mount_a_volume_read_write_and_read_only() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let layout = Layout::new(data.root());
    let volumes = LocalVolumes::new(layout.clone(), space_bin());
    let engine = engine(&data);
    assert!(engine.availability().available, "{}", engine.availability().detail);
    let volume = new_volume(51);
    volumes.create_volume(&volume, mib(16), None).unwrap();
    std::fs::write(data.root().join("host-only"), "host secret").unwrap();
    let host_only = data.root().join("host-only").to_string_lossy().into_owned();

    let writer = sandbox(&data, 51, vec![mount(&volume, "/workspace", false)]);
    let agent = engine.create(&writer).await.expect("a sandbox with a volume starts").agent;
    sh(&agent, "echo from-a > /workspace/shared.txt && mkdir -p /workspace/dir && sync").await;
    assert_eq!(std::fs::read_to_string(layout.volume_data(&volume).join("shared.txt")).unwrap(), "from-a\n");

    // Past the volume's 16 MiB: the sandbox's own writes fail with EDQUOT.
    let (_, err, exited) =
        run(&agent, &["dd", "if=/dev/zero", "of=/workspace/big", "bs=1M", "count=64", "conv=fsync"]).await;
    let said = String::from_utf8_lossy(&err);
    assert_ne!(exited.exit_code, Some(0), "a write past the volume's size fails: {said}");
    assert!(said.contains("quota"), "EDQUOT (Disk quota exceeded): {said}");
    sh(&agent, "rm -f /workspace/big").await;
    // The sandbox's root is its own, not the volume's quota.
    sh(&agent, "dd if=/dev/zero of=/root/big bs=1M count=24 conv=fsync 2>/dev/null && rm /root/big").await;

    // Links made inside resolve in the sandbox's view, not the host's.
    sh(&agent, "echo in-sandbox > /marker && ln -s / /workspace/link-root && ln -s .. /workspace/link-up").await;
    sh(&agent, "ln -s /proc/1/root /workspace/link-proc && ln -s /proc/self/root /workspace/link-self").await;
    assert_eq!(sh(&agent, "cat /workspace/link-root/marker").await, "in-sandbox\n");
    assert_eq!(sh(&agent, "cat /workspace/link-up/marker").await, "in-sandbox\n");
    assert_eq!(sh(&agent, "cat /workspace/link-self/marker").await, "in-sandbox\n");
    // PID 1 is the sandbox's agent, which no one may look into (it is
    // not dumpable): the link is refused inside, never the host's root.
    let (out, err, _) = run(&agent, &["cat", "/workspace/link-proc/marker"]).await;
    let (out, err) = (String::from_utf8_lossy(&out), String::from_utf8_lossy(&err));
    assert!(out == "in-sandbox\n" || err.contains("Permission denied"), "{out} {err}");
    for path in [
        format!("/workspace/link-root{host_only}"),
        format!("/workspace/link-up{host_only}"),
        format!("/workspace/link-proc{host_only}"),
        format!("/workspace/link-self{host_only}"),
        "/workspace/link-up/limit-mib".to_string(),
    ] {
        let (_, _, exited) = run(&agent, &["cat", &path]).await;
        assert_ne!(exited.exit_code, Some(0), "{path} is not the host's");
    }
    // A link the host made in the volume, read inside, is the sandbox's too.
    std::os::unix::fs::symlink(&host_only, layout.volume_data(&volume).join("link-host")).unwrap();
    let (_, _, exited) = run(&agent, &["cat", "/workspace/link-host"]).await;
    assert_ne!(exited.exit_code, Some(0), "a link to a host path resolves in the sandbox");

    // A second sandbox mounts it read-only and reads what the first wrote.
    let reader = sandbox(&data, 52, vec![mount(&volume, "/srv/data", true)]);
    let reading = engine.create(&reader).await.expect("a read-only mount starts").agent;
    // Its read-only view was the host's only while runsc set the sandbox up.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&reader.id), "no mount of the sandbox is left on the host: {mounts}");
    assert_eq!(sh(&reading, "cat /srv/data/shared.txt").await, "from-a\n");
    let (_, err, exited) = run(&reading, &["sh", "-c", "echo no > /srv/data/shared.txt"]).await;
    assert_ne!(exited.exit_code, Some(0));
    assert!(
        String::from_utf8_lossy(&err).contains("Read-only file system"),
        "EROFS: {}",
        String::from_utf8_lossy(&err)
    );
    let (_, _, exited) = run(&reading, &["mkdir", "/srv/data/new"]).await;
    assert_ne!(exited.exit_code, Some(0), "nothing is made in a read-only mount");
    // A refused write changed nothing (an `O_TRUNC` open included).
    let (_, _, exited) = run(&reading, &["truncate", "-s", "0", "/srv/data/shared.txt"]).await;
    assert_ne!(exited.exit_code, Some(0));
    assert_eq!(std::fs::read_to_string(layout.volume_data(&volume).join("shared.txt")).unwrap(), "from-a\n");
    // The writer still writes, and the reader sees it.
    sh(&agent, "echo again > /workspace/later.txt").await;
    assert_eq!(sh(&reading, "cat /srv/data/later.txt").await, "again\n");

    // The writer is gone; what it wrote stays for the next sandbox.
    engine.destroy(&writer).await.unwrap();
    assert_eq!(sh(&reading, "cat /srv/data/shared.txt").await, "from-a\n");
    engine.destroy(&reader).await.unwrap();
    assert_eq!(std::fs::read_to_string(layout.volume_data(&volume).join("shared.txt")).unwrap(), "from-a\n");

    // A start whose volume is not there is refused, and leaves nothing.
    let ghost = sandbox(&data, 53, vec![mount(&new_volume(59), "/workspace", false)]);
    let Err(err) = engine.create(&ghost).await else { panic!("a start with no such volume") };
    assert!(err.to_string().contains("is not on this host"), "{err}");
    assert!(!ghost.dir.exists());
    volumes.delete_volume(&volume).unwrap();
    assert!(!layout.volume_dir(&volume).exists(), "its read-only view went with it");
}

/// A suspend and a restore keep the sandbox's volumes: the restore's
/// bundle names them again, and the volume's files are the host's, as
/// they are now (not as they were at the suspend).
#[tokio::test(flavor = "multi_thread")]
async fn a_mount_survives_a_suspend_and_a_restore() {
    space_process::become_subreaper().unwrap();
    let data = TestDataDir::new();
    let layout = Layout::new(data.root());
    let volumes = LocalVolumes::new(layout.clone(), space_bin());
    let engine = engine(&data);
    let (volume, shared) = (new_volume(61), new_volume(62));
    volumes.create_volume(&volume, mib(64), None).unwrap();
    volumes.create_volume(&shared, mib(16), None).unwrap();
    std::fs::write(layout.volume_data(&shared).join("seed"), "seeded").unwrap();
    let spec = sandbox(&data, 61, vec![mount(&volume, "/workspace", false), mount(&shared, "/seed", true)]);
    let agent = engine.create(&spec).await.expect("create").agent;
    sh(&agent, "echo before > /workspace/kept.txt").await;

    agent.quiesce(PATIENCE).await.expect("quiesce");
    engine.suspend(&spec).await.expect("suspend");
    // Written while it slept, on the host: the restore sees it.
    std::fs::write(layout.volume_data(&volume).join("while-asleep"), "host").unwrap();
    let socket = engine.restore(&spec).await.expect("a restore with its volumes");
    agent.reattach(socket, PATIENCE).await.expect("reattach");
    assert_eq!(sh(&agent, "cat /workspace/kept.txt /workspace/while-asleep /seed/seed").await, "before\nhostseeded");
    sh(&agent, "echo after > /workspace/after.txt").await;
    assert_eq!(std::fs::read_to_string(layout.volume_data(&volume).join("after.txt")).unwrap(), "after\n");
    let (_, _, exited) = run(&agent, &["sh", "-c", "echo x > /seed/seed"]).await;
    assert_ne!(exited.exit_code, Some(0), "still read-only");
    assert_eq!(std::fs::read_to_string(layout.volume_data(&shared).join("seed")).unwrap(), "seeded");

    engine.destroy(&spec).await.unwrap();
    volumes.delete_volume(&volume).unwrap();
    volumes.delete_volume(&shared).unwrap();
}

/// A Firecracker node's volume is an image: gVisor binds directories, and
/// refuses it rather than show the sandbox the image file.
#[tokio::test(flavor = "multi_thread")]
async fn gvisor_refuses_to_mount_an_image_volume() {
    let data = TestDataDir::new();
    let layout = Layout::new(data.root());
    let volume = new_volume(51);
    LocalVolumes::new(layout.clone(), space_bin()).create_image_volume(&volume, mib(16)).unwrap();
    let spec = sandbox(&data, 51, vec![mount(&volume, "/workspace", false)]);
    let err = engine(&data).create(&spec).await.err().expect("refused");
    assert!(err.to_string().contains("is an ext4 image"), "{err}");
}

/// The files child on an image volume (decision 031), as the server opens
/// it: `write` the image itself through a loop device, else a copy taken
/// now. Shut down when dropped, as the server does, which ends the child.
struct ImageFiles(AgentConn, std::os::unix::net::UnixStream);

impl Drop for ImageFiles {
    fn drop(&mut self) {
        let _ = self.1.shutdown(std::net::Shutdown::Both);
    }
}

async fn image_files(host: &dyn VolumeHost, volume: &VolumeId, write: bool) -> ImageFiles {
    let socket = host.volume_files(volume, write).unwrap();
    let kept = socket.try_clone().unwrap();
    socket.set_nonblocking(true).unwrap();
    let socket = tokio::net::UnixStream::from_std(socket).unwrap();
    let agent = AgentConn::handshake(socket, welcome(volume), PATIENCE).await.expect("the child greets as an agent");
    ImageFiles(agent, kept)
}

/// Waits until no loop mount or copy of the volume's files children is
/// left (each goes once its child ended).
async fn files_mounts_gone(layout: &Layout, volume: &VolumeId) {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let left: Vec<_> = std::fs::read_dir(layout.volume_dir(volume))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("files-"))
            .map(|e| e.path())
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "left behind: {left:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Files routes without a sandbox on a Firecracker node's volume: a write
/// lands in the image; a read, taken while a writer (here the host kernel
/// through a loop device, in place of a microVM) has the image mounted,
/// sees a whole copy holding what the writer had synced, and never the
/// writer's later writes; nothing of either stays once they end.
async fn image_volume_files(host: &dyn VolumeHost, layout: &Layout, data: &TestDataDir, tag: u8) {
    let volume = new_volume(tag);
    host.create_image_volume(&volume, mib(32)).unwrap();

    let files = image_files(host, &volume, true).await;
    write_all(&files.0, "/seed.txt", b"through the files routes").await.unwrap();
    assert!(!layout.volume_data(&volume).join("seed.txt").exists(), "in the image, not beside it");
    drop(files);
    files_mounts_gone(layout, &volume).await;

    let writer = data.root().join(format!("writer-{tag}"));
    let _mounted = LoopMount::new(&layout.volume_image(&volume), &writer);
    assert_eq!(std::fs::read_to_string(writer.join("seed.txt")).unwrap(), "through the files routes");
    std::fs::write(writer.join("synced.txt"), "synced").unwrap();
    nix::unistd::sync();
    let files = image_files(host, &volume, false).await;
    let agent = &files.0;
    std::fs::write(writer.join("later.txt"), "later").unwrap();
    nix::unistd::sync();
    assert_eq!(read_all(agent, "/synced.txt").await.unwrap(), b"synced");
    assert_eq!(read_all(agent, "/seed.txt").await.unwrap(), b"through the files routes");
    not_found(read_all(agent, "/later.txt").await, "a write after the copy");
    let refused = write_all(agent, "/new.txt", b"x").await;
    assert!(refused.is_err(), "a read's copy is mounted read-only");
    drop(files);
    files_mounts_gone(layout, &volume).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_volumes_files_are_served_from_its_mounted_image_in_process() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    image_volume_files(&LocalVolumes::new(layout.clone(), space_bin()), &layout, &data, 61).await;
}

#[test]
fn an_image_volumes_files_are_served_from_its_mounted_image_through_the_helper() {
    let data = TestDataDir::with_templates(&[]);
    let layout = Layout::new(data.root());
    let Helper { runtime, client } = helper(&data, &layout);
    runtime.block_on(image_volume_files(&client, &layout, &data, 71));
    runtime.shutdown_timeout(PATIENCE);
}
