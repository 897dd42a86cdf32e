//! The helper's socket: frames and descriptors over a real Unix socket,
//! refusals of what does not parse, and the uid check with real processes
//! of another uid (those tests need root and say so when skipped).

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use space_privsep::peer::{Connection, HelperClient, HelperListener, PeerError};
use space_privsep::proto::{
    self, BuildSource, DiskMib, ProtoError, Refusal, Reply, Request, SandboxId, TemplateName, TemplateRef,
    TemplateVersion, MAX_FRAME,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::time::timeout;

/// Every wait in these tests ends by then.
const DEADLINE: Duration = Duration::from_secs(20);
/// The uid the child processes take.
const NOBODY: u32 = 65534;
/// Set in a child process: the helper socket it connects to.
const CHILD_ENV: &str = "SPACE_PRIVSEP_PEER_CHILD";

fn me() -> u32 {
    nix::unistd::geteuid().as_raw()
}

fn sandbox() -> SandboxId {
    SandboxId::parse("sbx_00112233445566778899").unwrap()
}

fn pair() -> (Connection, UnixStream) {
    let (helper, client) = UnixStream::pair().unwrap();
    (Connection::checked(helper, me()).unwrap(), client)
}

/// A pipe holding `text`, its read end returned.
fn pipe_with(text: &[u8]) -> OwnedFd {
    let (read, write) = nix::unistd::pipe().unwrap();
    let mut write = std::fs::File::from(write);
    write.write_all(text).unwrap();
    read
}

fn read_all(fd: OwnedFd) -> Vec<u8> {
    let mut text = Vec::new();
    std::fs::File::from(fd).read_to_end(&mut text).unwrap();
    text
}

async fn read_reply(stream: &mut UnixStream) -> Reply {
    let mut header = [0u8; 4];
    timeout(DEADLINE, stream.read_exact(&mut header)).await.unwrap().unwrap();
    let mut body = vec![0u8; proto::body_len(header).unwrap()];
    timeout(DEADLINE, stream.read_exact(&mut body)).await.unwrap().unwrap();
    proto::decode_reply(&body).unwrap()
}

#[tokio::test]
async fn requests_replies_and_descriptors_cross_the_socket() {
    let (helper, client) = pair();
    let mut client = HelperClient::over(client);
    let serve = tokio::spawn(async move {
        let incoming = helper.recv().await.unwrap().unwrap();
        let mut fds = incoming.fds.into_iter();
        assert_eq!(read_all(fds.next().unwrap()), b"a log");
        assert_eq!(read_all(fds.next().unwrap()), b"an archive's bytes");
        let listener = pipe_with(b"a listener");
        helper.send(&Reply::Listening {}, &[listener.as_fd()]).await.unwrap();
        // The end of the stream between requests is a clean close.
        assert!(helper.recv().await.unwrap().is_none());
        incoming.request
    });
    let request = Request::BuildTemplate {
        template: TemplateRef { name: TemplateName::parse("img").unwrap(), version: TemplateVersion::new(1).unwrap() },
        source: BuildSource::OciArchive {},
        disk_mib: DiskMib::new(100).unwrap(),
    };
    let (log, archive) = (pipe_with(b"a log"), pipe_with(b"an archive's bytes"));
    let (reply, fds) =
        timeout(DEADLINE, client.call(&request, &[log.as_fd(), archive.as_fd()])).await.unwrap().unwrap();
    assert_eq!(reply, Reply::Listening {});
    assert_eq!(read_all(fds.into_iter().next().unwrap()), b"a listener");
    drop(client);
    assert_eq!(timeout(DEADLINE, serve).await.unwrap().unwrap(), request);
}

#[tokio::test]
async fn a_message_is_sent_only_with_the_descriptors_it_announces() {
    let (_helper, client) = pair();
    let mut client = HelperClient::over(client);
    let stray = pipe_with(b"");
    let err = client.call(&Request::Pause { sandbox: sandbox() }, &[stray.as_fd()]).await.unwrap_err();
    assert!(matches!(err, PeerError::Proto(ProtoError::Descriptors { expected: 0, received: 1 })), "{err}");
}

#[tokio::test]
async fn a_descriptor_the_request_does_not_announce_is_refused() {
    let (helper, client) = pair();
    let frame = proto::encode(&Request::Pause { sandbox: sandbox() }).unwrap();
    let stray = pipe_with(b"");
    let raw = [stray.as_raw_fd()];
    let client = client.into_std().unwrap();
    client.set_nonblocking(false).unwrap();
    sendmsg::<()>(
        client.as_raw_fd(),
        &[IoSlice::new(&frame)],
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    let err = timeout(DEADLINE, helper.recv()).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::Proto(ProtoError::Descriptors { expected: 0, received: 1 })), "{err}");
}

#[tokio::test]
async fn more_descriptors_than_a_message_may_carry_are_refused_and_closed() {
    let (helper, client) = pair();
    let frame = proto::encode(&Request::Pause { sandbox: sandbox() }).unwrap();
    let (read, write) = nix::unistd::pipe().unwrap();
    let raw = [read.as_raw_fd(); space_privsep::proto::MAX_FDS + 1];
    let client = client.into_std().unwrap();
    client.set_nonblocking(false).unwrap();
    sendmsg::<()>(
        client.as_raw_fd(),
        &[IoSlice::new(&frame)],
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    drop(read);
    let err = timeout(DEADLINE, helper.recv()).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::TooManyDescriptors), "{err}");
    // Neither copy stayed open in the helper: the pipe has no reader left.
    let written = nix::unistd::write(&write, b"x");
    assert_eq!(written, Err(nix::errno::Errno::EPIPE));
}

#[tokio::test]
async fn an_oversized_frame_is_refused_before_its_body_is_read() {
    let (helper, mut client) = pair();
    // No body follows: the refusal must come from the header alone.
    client.write_all(&(MAX_FRAME as u32 + 1).to_be_bytes()).await.unwrap();
    let err = timeout(DEADLINE, helper.recv()).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::Proto(ProtoError::TooLarge(len)) if len == MAX_FRAME + 1), "{err}");
    refused_as_bad_request(&helper, err, &mut client, "over the 262144-byte limit").await;
}

#[tokio::test]
async fn malformed_json_is_refused_with_a_clear_answer() {
    let (helper, mut client) = pair();
    let body = br#"{"op":"destroy","sandbox":"sbx_../../etc"}"#;
    client.write_all(&(body.len() as u32).to_be_bytes()).await.unwrap();
    client.write_all(body).await.unwrap();
    let err = timeout(DEADLINE, helper.recv()).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::Proto(ProtoError::Malformed(_))), "{err}");
    refused_as_bad_request(&helper, err, &mut client, "not a sandbox id").await;
}

/// The helper answers `err` as a refusal, and the client reads a bad
/// request whose message says `why`.
async fn refused_as_bad_request(helper: &Connection, err: PeerError, client: &mut UnixStream, why: &str) {
    helper.refuse(&err).await.unwrap();
    match read_reply(client).await {
        Reply::Refused { refusal: Refusal::BadRequest, message } => assert!(message.contains(why), "{message}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_frame_cut_short_is_an_error_not_a_request() {
    let (helper, mut client) = pair();
    client.write_all(&100u32.to_be_bytes()).await.unwrap();
    client.write_all(b"{\"op\":").await.unwrap();
    drop(client);
    let err = timeout(DEADLINE, helper.recv()).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::Truncated), "{err}");
}

#[tokio::test]
async fn the_first_message_must_be_a_hello() {
    let (helper, client) = pair();
    let mut client = HelperClient::over(client);
    let serve = tokio::spawn(async move { helper.hello().await });
    let (reply, _) = timeout(DEADLINE, client.call(&Request::List {}, &[])).await.unwrap().unwrap();
    assert!(matches!(reply, Reply::Refused { refusal: Refusal::BadRequest, .. }), "{reply:?}");
    assert!(matches!(timeout(DEADLINE, serve).await.unwrap().unwrap(), Err(PeerError::NoHello)));
}

/// A scratch directory every uid may enter, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("space-privsep-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Scratch(dir)
    }

    fn socket(&self) -> PathBuf {
        self.0.join("helper.sock")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn skip_unless_root(test: &str) -> bool {
    if me() != 0 {
        eprintln!("SKIPPED {test}: it needs root to start a process of another uid");
        return true;
    }
    false
}

/// Runs [`child_connects_to_the_helper`] in a process of uid `uid`.
fn spawn_child(uid: u32, socket: &Path) -> tokio::process::Child {
    tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_connects_to_the_helper", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, socket)
        .uid(uid)
        .gid(uid)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn child_output(child: tokio::process::Child) -> String {
    let out = timeout(DEADLINE, child.wait_with_output()).await.expect("the child ends").unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// In a child process only: connects to the helper as its uid, then asks
/// for a pause and prints what came back.
#[tokio::test]
async fn child_connects_to_the_helper() {
    let Ok(socket) = std::env::var(CHILD_ENV) else { return };
    let said = async {
        let mut client = HelperClient::connect(Path::new(&socket), 0).await?;
        let (reply, _) = client.call(&Request::Pause { sandbox: sandbox() }, &[]).await?;
        Ok::<_, PeerError>(reply)
    };
    match timeout(DEADLINE, said).await {
        Ok(Ok(reply)) => println!("CHILD uid {} got {reply:?}", me()),
        Ok(Err(err)) => println!("CHILD uid {} failed: {err}", me()),
        Err(_) => println!("CHILD timed out"),
    }
}

#[tokio::test]
async fn a_connection_from_another_uid_is_refused() {
    if skip_unless_root("a_connection_from_another_uid_is_refused") {
        return;
    }
    let scratch = Scratch::new("other-uid");
    let listener = HelperListener::bind(&scratch.socket(), 4242).unwrap();
    // The file's mode would refuse nobody first; opened up here so that
    // this test is of the SO_PEERCRED check alone.
    std::fs::set_permissions(scratch.socket(), std::fs::Permissions::from_mode(0o666)).unwrap();
    let child = spawn_child(NOBODY, &scratch.socket());
    let err = timeout(DEADLINE, listener.accept()).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::UnexpectedPeer { uid: NOBODY, allowed: 4242, .. }), "{err}");
    let said = child_output(child).await;
    assert!(said.contains("CHILD uid 65534 failed"), "{said}");
}

#[tokio::test]
async fn root_is_refused_too() {
    if skip_unless_root("root_is_refused_too") {
        return;
    }
    let scratch = Scratch::new("root");
    let listener = HelperListener::bind(&scratch.socket(), NOBODY).unwrap();
    let _client = UnixStream::connect(scratch.socket()).await.unwrap();
    let err = timeout(DEADLINE, listener.accept()).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::UnexpectedPeer { uid: 0, allowed: NOBODY, .. }), "{err}");
}

#[tokio::test]
async fn the_allowed_uid_is_served() {
    if skip_unless_root("the_allowed_uid_is_served") {
        return;
    }
    let scratch = Scratch::new("allowed");
    let listener = HelperListener::bind(&scratch.socket(), NOBODY).unwrap();
    let meta = std::fs::metadata(scratch.socket()).unwrap();
    assert_eq!((std::os::unix::fs::MetadataExt::uid(&meta), meta.permissions().mode() & 0o777), (NOBODY, 0o600));
    let child = spawn_child(NOBODY, &scratch.socket());
    let helper = timeout(DEADLINE, listener.accept()).await.unwrap().unwrap();
    assert_eq!(helper.peer().uid, NOBODY);
    timeout(DEADLINE, helper.hello()).await.unwrap().unwrap();
    let incoming = timeout(DEADLINE, helper.recv()).await.unwrap().unwrap().unwrap();
    assert_eq!(incoming.request, Request::Pause { sandbox: sandbox() });
    helper.send(&Reply::Done {}, &[]).await.unwrap();
    let said = child_output(child).await;
    assert!(said.contains("CHILD uid 65534 got Done"), "{said}");
}

#[tokio::test]
async fn a_client_refuses_a_socket_the_helper_does_not_serve() {
    let scratch = Scratch::new("impostor");
    let _impostor = tokio::net::UnixListener::bind(scratch.socket()).unwrap();
    let helper_uid = me().wrapping_add(1);
    let err = timeout(DEADLINE, HelperClient::connect(&scratch.socket(), helper_uid)).await.unwrap().unwrap_err();
    assert!(matches!(err, PeerError::UnexpectedHelper { expected, .. } if expected == helper_uid), "{err}");
}
