//! The files API on real sandboxes: streamed both ways, paths resolved only
//! inside the sandbox.

mod common;

use common::TestServer;
use serde_json::json;
use space_testkit::TestDataDir;

#[test]
fn files_are_written_read_listed_and_deleted_inside_the_sandbox() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let client = server.client();
    let files = |query: &str| format!("/v1/sandboxes/{id}/files?{query}");

    // A parameter the action would not honour is refused, not ignored.
    for (method, query) in [
        ("GET", "path=/root&mode=0600"),
        ("GET", "path=/root&recursive=true"),
        ("PUT", "path=/root/t&recursive=false"),
        ("PUT", "path=/root/t&format=tar&mode=0600"),
        ("DELETE", "path=/root/none&format=tar"),
        ("DELETE", "path=/root/none&mode=0600"),
    ] {
        let (status, body) = client.exchange(method, &files(query), Some("")).unwrap();
        assert_eq!(status, 400, "{method} {query}: {body}");
        assert!(body.contains("applies to"), "{body}");
    }

    // Write with parents created and a mode; read it back, also from a command.
    let written = client.call_bytes("PUT", &files("path=/root/dir/sub/hello.txt&mode=0600"), &[], Some(b"hello\n"));
    let written = written.unwrap();
    assert_eq!(written.status, 201);
    let written: serde_json::Value = serde_json::from_slice(&written.body).unwrap();
    server.check("PUT", &format!("/v1/sandboxes/{id}/files"), 201, "application/json", &written);
    assert_eq!(written["size"], 6);
    let read = client.call_bytes("GET", &files("path=/root/dir/sub/hello.txt"), &[], None).unwrap();
    assert_eq!((read.status, read.header("x-file-mode")), (200, Some("0600")));
    assert_eq!(read.body, b"hello\n");
    assert_eq!(
        server.exec(&id, json!({"cmd": "stat -c %a /root/dir/sub/hello.txt; cat /root/dir/sub/hello.txt"}))["stdout"],
        "600\nhello\n"
    );

    // Binary content of a few MiB survives the round trip.
    let blob: Vec<u8> = (0..3_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    client.upload_bytes(&id, "/tmp/blob.bin", &blob).unwrap();
    let mut back = Vec::new();
    client.download(&id, "/tmp/blob.bin", &mut back).unwrap();
    assert!(back == blob, "binary content changed on the way");
    let local = data.root().join("blob.bin");
    std::fs::write(&local, &blob).unwrap();
    let host_sum =
        space_testkit::run_within(std::process::Command::new("sha256sum").arg(&local), space_testkit::PATIENCE)
            .unwrap();
    let host_sum = String::from_utf8_lossy(&host_sum).split_whitespace().next().unwrap().to_string();
    let sum = server.exec(&id, json!({"cmd": "sha256sum /tmp/blob.bin"}));
    assert_eq!(sum["stdout"].as_str().unwrap().split_whitespace().next().unwrap(), host_sum, "bit-exact inside");

    // Directory listing.
    let (status, listing) = server.call("GET", &format!("/v1/sandboxes/{id}/files?path=/root/dir/sub"), None);
    assert_eq!(status, 200);
    assert_eq!(listing["entries"][0]["name"], "hello.txt");
    assert_eq!(listing["entries"][0]["type"], "file");
    assert_eq!(listing["entries"][0]["mode"], "0600");
    assert_eq!(listing["entries"][0]["size"], 6);

    // Errors.
    server.error("GET", &format!("/v1/sandboxes/{id}/files?path=/nope"), None, 404, "file_not_found");
    server.error("GET", &format!("/v1/sandboxes/{id}/files?path=relative/path"), None, 400, "invalid_request");
    server.error("DELETE", &format!("/v1/sandboxes/{id}/files?path=/root/dir"), None, 409, "directory_not_empty");
    let (status, _) = client.call("DELETE", &files("path=/root/dir&recursive=true"), None).unwrap();
    assert_eq!(status, 204);
    server.error("GET", &format!("/v1/sandboxes/{id}/files?path=/root/dir/sub/hello.txt"), None, 404, "file_not_found");
    server.error("DELETE", &format!("/v1/sandboxes/{id}/files?path=/"), None, 400, "invalid_request");
}

#[test]
fn dotdot_and_symlinks_never_leave_the_sandbox() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let client = server.client();
    server.exec(&id, json!({"cmd": "ln -s / /root/escape && ln -s ../../../../../.. /root/up"}));
    let marker = format!("space-escape-{}", std::process::id());

    // Reads through `..` and links see the sandbox's own files, and a
    // file that exists only on the host is not found.
    server.exec(&id, json!({"cmd": format!("echo inside > /srv/{marker}")}));
    let host_only = std::env::temp_dir().join(format!("{marker}-host"));
    std::fs::write(&host_only, "host").unwrap();
    // Status and body of a GET of `path`.
    let get = |path: &str| {
        client
            .exchange("GET", &format!("/v1/sandboxes/{id}/files?path={path}"), None)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    for path in
        [format!("/root/../srv/{marker}"), format!("/root/escape/srv/{marker}"), format!("/root/up/srv/{marker}")]
    {
        assert_eq!(get(&path), (200, "inside\n".to_string()), "{path} resolved inside the sandbox");
    }
    for path in [format!("/root/escape{}", host_only.display()), format!("/root/up/..{}", host_only.display())] {
        assert_eq!(get(&path).0, 404, "{path} must not reach the host");
    }
    std::fs::remove_file(&host_only).unwrap();
    // Writes through them land in the sandbox, never on the host.
    for path in [format!("/root/escape/tmp/{marker}"), format!("/root/up/../../tmp/{marker}")] {
        client.upload_bytes(&id, &path, b"inside").unwrap();
    }
    assert!(!std::path::Path::new(&format!("/tmp/{marker}")).exists(), "nothing was written on the host");
    assert_eq!(server.exec(&id, json!({"argv": ["cat", format!("/tmp/{marker}")]}))["stdout"], "inside");
}

#[test]
fn directories_travel_as_tar_archives_both_ways() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let client = server.client();
    server.exec(&id, json!({"cmd": "mkdir -p /srv/tree/a/b && echo one > /srv/tree/a/one.txt && printf 'two' > /srv/tree/a/b/two.bin && chmod 0750 /srv/tree/a/b && ln -s one.txt /srv/tree/a/link"}));

    let tree = format!("/v1/sandboxes/{id}/files?path=/srv/tree&format=tar");
    let response = client.call_bytes("GET", &tree, &[], None).unwrap();
    assert_eq!((response.status, response.header("content-type")), (200, Some("application/x-tar")));
    let archive = response.body;
    let names: Vec<String> = tar::Archive::new(&archive[..])
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().to_string_lossy().trim_start_matches("./").to_string())
        .collect();
    for expected in ["a/one.txt", "a/b/two.bin", "a/link"] {
        assert!(names.iter().any(|n| n == expected), "{expected} in {names:?}");
    }

    // The same archive unpacks into another directory, modes and links kept.
    let copy = format!("/v1/sandboxes/{id}/files?path=/root/copy&format=tar");
    let put = client.call_bytes("PUT", &copy, &[], Some(&archive)).unwrap();
    assert_eq!(put.status, 201, "{}", String::from_utf8_lossy(&put.body));
    let check = server.exec(&id, json!({"cmd": "cat /root/copy/a/one.txt /root/copy/a/b/two.bin; echo; stat -c %a /root/copy/a/b; readlink /root/copy/a/link"}));
    assert_eq!(check["stdout"], "one\ntwo\n750\none.txt\n");

    // A hostile archive cannot write outside the target directory.
    let mut evil = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(4);
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Regular);
    let name = b"../../escaped.txt";
    header.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name);
    header.set_cksum();
    evil.append(&header, &b"evil"[..]).unwrap();
    let evil = evil.into_inner().unwrap();
    let target = format!("/v1/sandboxes/{id}/files?path=/root/target&format=tar");
    let refused = client.call_bytes("PUT", &target, &[], Some(&evil)).unwrap();
    let body = String::from_utf8_lossy(&refused.body);
    assert_eq!(refused.status, 400, "a traversal entry must be refused: {body}");
    assert!(body.contains("outside the directory"), "the refusal says why: {body}");
    let outside = server.exec(&id, json!({"cmd": "ls /escaped.txt /root/escaped.txt 2>&1 | grep -c 'No such'"}));
    assert_eq!(outside["stdout"], "2\n", "nothing landed outside the target");
}

#[test]
fn a_tar_upload_lands_whole_or_not_at_all() {
    let data = TestDataDir::new();
    let server = TestServer::start(&data);
    let id = server.create_sandbox(json!({"template": "base"}));
    let client = server.client();
    let put = |dir: &str, archive: Vec<u8>| {
        let path = format!("/v1/sandboxes/{id}/files?path={dir}&format=tar");
        let answer = client.call_bytes("PUT", &path, &[], Some(&archive)).unwrap_or_else(|e| panic!("PUT {path}: {e}"));
        (answer.status, String::from_utf8_lossy(&answer.body).into_owned())
    };
    let sh = |cmd: &str| server.exec(&id, json!({"cmd": cmd}))["stdout"].as_str().unwrap_or_default().to_string();

    // A good archive merges into a directory that has files: those it names
    // are replaced, the others stay, modes of directories it does not name too.
    sh("mkdir -p /root/merge/sub && chmod 0700 /root/merge/sub && echo keep > /root/merge/keep.txt \
        && echo old > /root/merge/over.txt && echo inner > /root/merge/sub/inner.txt");
    let mut good = tar::Builder::new(Vec::new());
    common::tar_entry(&mut good, "over.txt", tar::EntryType::Regular, b"new\n", None);
    common::tar_entry(&mut good, "sub/added.txt", tar::EntryType::Regular, b"added\n", None);
    common::tar_entry(&mut good, "fresh/", tar::EntryType::Directory, b"", None);
    common::tar_entry(&mut good, "fresh/x.txt", tar::EntryType::Regular, b"x\n", None);
    assert_eq!(put("/root/merge", good.into_inner().unwrap()).0, 201);
    let merged =
        sh("cd /root/merge && ls -A . sub fresh && cat keep.txt over.txt sub/inner.txt sub/added.txt fresh/x.txt \
        && stat -c %a sub");
    assert_eq!(
        merged,
        ".:\nfresh\nkeep.txt\nover.txt\nsub\n\nfresh:\nx.txt\n\nsub:\nadded.txt\ninner.txt\nkeep\nnew\ninner\nadded\nx\n700\n"
    );

    // Refused at its last entry, into a new directory: not even the
    // directory is left.
    let mut climbing = tar::Builder::new(Vec::new());
    common::tar_entry(&mut climbing, "first.txt", tar::EntryType::Regular, b"one", None);
    common::tar_entry(&mut climbing, "sub/", tar::EntryType::Directory, b"", None);
    common::tar_entry(&mut climbing, "sub/second.txt", tar::EntryType::Regular, b"two", None);
    common::tar_entry(&mut climbing, "../climbed.txt", tar::EntryType::Regular, b"out", None);
    let (status, body) = put("/root/new/deeper", climbing.into_inner().unwrap());
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("outside the directory"), "{body}");
    assert_eq!(sh("ls -A /root/new /root/climbed.txt 2>&1 | grep -c 'No such'"), "2\n", "nothing is left");

    // Refused at an entry through a link out of the directory, into one
    // that has a file of the same name: the file is as it was.
    let mut through = tar::Builder::new(Vec::new());
    common::tar_entry(&mut through, "keep.txt", tar::EntryType::Regular, b"replaced\n", None);
    common::tar_entry(&mut through, "planted.txt", tar::EntryType::Regular, b"planted", None);
    common::tar_entry(&mut through, "out", tar::EntryType::Symlink, b"", Some("/etc"));
    common::tar_entry(&mut through, "out/planted", tar::EntryType::Regular, b"x", None);
    let (status, body) = put("/root/merge", through.into_inner().unwrap());
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("outside the directory"), "{body}");
    assert_eq!(
        sh("ls -A /root/merge; cat /root/merge/keep.txt; ls /etc/planted 2>&1 | grep -c 'No such'"),
        "fresh\nkeep.txt\nover.txt\nsub\nkeep\n1\n"
    );

    // A directory where the target has a file is refused before anything moves.
    let mut clash = tar::Builder::new(Vec::new());
    common::tar_entry(&mut clash, "over.txt/", tar::EntryType::Directory, b"", None);
    common::tar_entry(&mut clash, "over.txt/x", tar::EntryType::Regular, b"x", None);
    common::tar_entry(&mut clash, "zzz.txt", tar::EntryType::Regular, b"z", None);
    let (status, body) = put("/root/merge", clash.into_inner().unwrap());
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("wrong_file_type") && body.contains("not a directory"), "{body}");
    assert_eq!(sh("ls -A /root/merge; cat /root/merge/over.txt"), "fresh\nkeep.txt\nover.txt\nsub\nnew\n");
}
