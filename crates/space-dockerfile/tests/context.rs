//! COPY layers from a build context tar: what is selected, where it lands,
//! who owns it, and what is refused.

use std::io::{Read, Write};

use space_dockerfile::{copy_layer, CopyError, CopyFrom, CopyStats, CopyStep, Ignore};

enum Member<'a> {
    File(&'a str, &'a [u8], u32),
    Dir(&'a str),
    Symlink(&'a str, &'a str),
    HardLink(&'a str, &'a str),
}

fn context(members: &[Member]) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    for member in members {
        let mut header = tar::Header::new_gnu();
        header.set_uid(501);
        header.set_gid(20);
        header.set_mtime(1_700_000_000);
        match member {
            Member::File(path, data, mode) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(*mode);
                header.set_size(data.len() as u64);
                tar.append_data(&mut header, path, *data).unwrap();
            }
            Member::Dir(path) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o750);
                header.set_size(0);
                tar.append_data(&mut header, path, std::io::empty()).unwrap();
            }
            Member::Symlink(path, target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_mode(0o777);
                header.set_size(0);
                tar.append_link(&mut header, path, target).unwrap();
            }
            Member::HardLink(path, target) => {
                header.set_entry_type(tar::EntryType::Link);
                header.set_size(0);
                tar.append_link(&mut header, path, target).unwrap();
            }
        }
    }
    tar.into_inner().unwrap()
}

/// A context member that names its own path (tar::Builder refuses `..`).
fn raw_member(path: &str) -> Vec<u8> {
    let mut header = tar::Header::new_old();
    header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(0o644);
    header.set_size(0);
    header.set_cksum();
    let mut out = header.as_bytes().to_vec();
    out.extend_from_slice(&[0; 1024]);
    out
}

fn step(sources: &[&str], dest: &str) -> CopyStep {
    CopyStep {
        from: CopyFrom::Context,
        sources: sources.iter().map(|s| s.to_string()).collect(),
        dest: dest.into(),
        chown: None,
        chmod: None,
        unpack: false,
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Out {
    path: String,
    kind: char,
    mode: u32,
    owner: (u64, u64),
    content: String,
}

fn run(context: &[u8], ignore: &Ignore, step: &CopyStep) -> Result<(Vec<Out>, CopyStats), CopyError> {
    let mut layer = Vec::new();
    let stats = copy_layer(context, ignore, step, &mut layer)?;
    let mut archive = tar::Archive::new(&layer[..]);
    let mut out = Vec::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let header = entry.header();
        let kind = match header.entry_type() {
            tar::EntryType::Regular => 'f',
            tar::EntryType::Directory => 'd',
            tar::EntryType::Symlink => 'l',
            tar::EntryType::Link => 'h',
            other => panic!("{other:?}"),
        };
        let (mode, owner) = (header.mode().unwrap(), (header.uid().unwrap(), header.gid().unwrap()));
        let path = entry.path().unwrap().to_string_lossy().trim_end_matches('/').to_string();
        let content = match kind {
            'l' | 'h' => entry.link_name().unwrap().unwrap().to_string_lossy().into_owned(),
            _ => {
                let mut bytes = Vec::new();
                entry.read_to_end(&mut bytes).unwrap();
                String::from_utf8_lossy(&bytes).into_owned()
            }
        };
        out.push(Out { path, kind, mode, owner, content });
    }
    Ok((out, stats))
}

fn paths(out: &[Out]) -> Vec<&str> {
    out.iter().map(|o| o.path.as_str()).collect()
}

fn none() -> Ignore {
    Ignore::default()
}

fn sample() -> Vec<u8> {
    context(&[
        Member::File("a.py", b"print(1)\n", 0o644),
        Member::File("b.py", b"print(2)\n", 0o755),
        Member::File("c.txt", b"c", 0o600),
        Member::Dir("src"),
        Member::File("src/d.py", b"d", 0o644),
        Member::File("src/sub/e.rs", b"e", 0o644),
        Member::Symlink("src/link", "d.py"),
        Member::File("./docs/README.md", b"readme", 0o644),
        Member::File("docs/other.md", b"other", 0o644),
    ])
}

#[test]
fn a_glob_copies_what_it_matches_into_a_directory() {
    let (out, stats) = run(&sample(), &none(), &step(&["*.py"], "/app/")).unwrap();
    assert_eq!(paths(&out), ["app/a.py", "app/b.py"]);
    assert_eq!(
        out[1],
        Out { path: "app/b.py".into(), kind: 'f', mode: 0o755, owner: (0, 0), content: "print(2)\n".into() }
    );
    assert_eq!((stats.files, stats.bytes), (2, 18));
}

#[test]
fn a_directory_source_copies_its_contents_with_made_up_parents() {
    let (out, _) = run(&sample(), &none(), &step(&["src"], "/app")).unwrap();
    assert_eq!(paths(&out), ["app/d.py", "app/sub", "app/sub/e.rs", "app/link"]);
    assert_eq!((out[1].kind, out[1].mode, out[1].owner), ('d', 0o755, (0, 0)));
    // The whole context, from its root, to the root.
    let (out, _) = run(&sample(), &none(), &step(&["."], "/")).unwrap();
    assert!(paths(&out).contains(&"src/sub/e.rs"), "{:?}", paths(&out));
    assert!(paths(&out).contains(&"docs/README.md"), "{:?}", paths(&out));
    // A glob that names a directory copies its contents, one level up, as Docker does.
    let (out, _) = run(&sample(), &none(), &step(&["sr?"], "/x/")).unwrap();
    assert_eq!(paths(&out), ["x/d.py", "x/sub", "x/sub/e.rs", "x/link"]);
}

#[test]
fn one_file_to_a_file_or_into_a_directory() {
    let (out, _) = run(&sample(), &none(), &step(&["c.txt"], "/etc/app.conf")).unwrap();
    assert_eq!(paths(&out), ["etc/app.conf"]);
    let (out, _) = run(&sample(), &none(), &step(&["/src/d.py"], "/etc/")).unwrap();
    assert_eq!(paths(&out), ["etc/d.py"]);
    let (out, _) = run(&sample(), &none(), &step(&["c.txt", "a.py"], "/etc/")).unwrap();
    assert_eq!(paths(&out), ["etc/a.py", "etc/c.txt"]);
    let e = run(&sample(), &none(), &step(&["*.py"], "/etc/one.py")).unwrap_err();
    assert!(matches!(e, CopyError::ManyToOneFile(_)), "{e}");
}

#[test]
fn chown_and_chmod_set_owner_and_mode() {
    let mut copy = step(&["src"], "/app/");
    copy.chown = Some("1000:1001".into());
    copy.chmod = Some(0o640);
    let (out, _) = run(&sample(), &none(), &copy).unwrap();
    for entry in out.iter().filter(|o| o.kind == 'f') {
        assert_eq!((entry.mode, entry.owner), (0o640, (1000, 1001)), "{entry:?}");
    }
    let made_up = out.iter().find(|o| o.path == "app/sub").unwrap();
    assert_eq!(made_up.owner, (1000, 1001));
    copy.chown = Some("1000".into());
    let (out, _) = run(&sample(), &none(), &copy).unwrap();
    assert_eq!(out[0].owner, (1000, 1000));
    copy.chown = Some("app:app".into());
    let e = run(&sample(), &none(), &copy).unwrap_err();
    assert!(matches!(&e, CopyError::OwnerName(name) if name == "app:app"), "{e}");
    assert!(e.to_string().contains("names are looked up in the image first"), "{e}");
}

#[test]
fn sources_outside_the_context_are_refused_and_absolute_ones_stay_inside() {
    for source in ["../x", "src/../../x", "/../../etc/passwd"] {
        let e = run(&sample(), &none(), &step(&[source], "/app/")).unwrap_err();
        assert!(matches!(e, CopyError::OutsideContext(_)), "{source}: {e}");
    }
    let (out, _) = run(&sample(), &none(), &step(&["/c.txt"], "/app/")).unwrap();
    assert_eq!(paths(&out), ["app/c.txt"]);
    let hostile = [raw_member("../evil"), vec![0; 1024]].concat();
    let e = run(&hostile, &none(), &step(&["."], "/")).unwrap_err();
    assert!(matches!(e, CopyError::BadMember(_)), "{e}");
}

#[test]
fn a_missing_or_ignored_source_is_named() {
    let e = run(&sample(), &none(), &step(&["a.py", "nope.txt"], "/app/")).unwrap_err();
    assert!(matches!(&e, CopyError::NotFound(name) if name == "nope.txt"), "{e}");
    let e = run(&sample(), &none(), &step(&["*.go"], "/app/")).unwrap_err();
    assert!(matches!(&e, CopyError::NotFound(name) if name == "*.go"), "{e}");
    let ignore = Ignore::parse("c.txt\n").unwrap();
    let e = run(&sample(), &ignore, &step(&["c.txt"], "/app/")).unwrap_err();
    assert!(e.to_string().contains("excluded by .dockerignore"), "{e}");
}

#[test]
fn dockerignore_filters_and_reincludes() {
    let ignore = Ignore::parse("docs\n!docs/README.md\n*.py\n").unwrap();
    let (out, _) = run(&sample(), &ignore, &step(&["."], "/app/")).unwrap();
    assert_eq!(
        paths(&out),
        [
            "app/c.txt",
            "app/src",
            "app/src/d.py",
            "app/src/sub",
            "app/src/sub/e.rs",
            "app/src/link",
            "app/docs",
            "app/docs/README.md"
        ]
    );
}

#[test]
fn symlinks_stay_symlinks_and_hard_links_follow_their_file() {
    let (out, _) = run(&sample(), &none(), &step(&["src/link"], "/app/")).unwrap();
    assert_eq!(out, [Out { path: "app/link".into(), kind: 'l', mode: 0o777, owner: (0, 0), content: "d.py".into() }]);
    let linked = context(&[Member::File("bin/tool", b"x", 0o755), Member::HardLink("bin/alias", "bin/tool")]);
    let (out, _) = run(&linked, &none(), &step(&["bin"], "/usr/local/bin/")).unwrap();
    assert_eq!(out[1].kind, 'h');
    assert_eq!(out[1].content, "usr/local/bin/tool");
    let e = run(&linked, &none(), &step(&["bin/alias"], "/x")).unwrap_err();
    assert!(matches!(e, CopyError::HardLink { .. }), "{e}");
}

#[test]
fn add_unpacks_local_archives() {
    let inner =
        context(&[Member::Dir("pkg"), Member::File("pkg/lib.py", b"lib", 0o644), Member::Symlink("pkg/l", "lib.py")]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&inner).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::stream::encode_all(&inner[..], 3).unwrap();
    let ctx = context(&[
        Member::File("app.tar.gz", &gz, 0o644),
        Member::File("app.tar.zst", &zst, 0o644),
        Member::File("plain.tar", &inner, 0o644),
    ]);
    for source in ["app.tar.gz", "app.tar.zst", "plain.tar"] {
        let mut add = step(&[source], "/opt/");
        add.unpack = true;
        let (out, _) = run(&ctx, &none(), &add).unwrap();
        assert_eq!(paths(&out), ["opt/pkg", "opt/pkg/lib.py", "opt/pkg/l"], "{source}");
        assert_eq!(out[1].owner, (501, 20), "the archive's owners stay");
        assert_eq!(out[1].content, "lib");
    }
    // Not marked: the archive is copied as a file.
    let (out, _) = run(&ctx, &none(), &step(&["app.tar.gz"], "/opt/")).unwrap();
    assert_eq!(paths(&out), ["opt/app.tar.gz"]);
}

#[test]
fn the_inputs_digest_follows_content_mode_and_owner() {
    let digest = |members: &[Member], chown: Option<&str>| {
        let mut copy = step(&["."], "/app/");
        copy.chown = chown.map(str::to_string);
        run(&context(members), &none(), &copy).unwrap().1.digest_of_inputs
    };
    let base = digest(&[Member::File("a", b"1", 0o644), Member::File("b", b"2", 0o644)], None);
    assert_eq!(
        base,
        digest(&[Member::File("b", b"2", 0o644), Member::File("a", b"1", 0o644)], None),
        "order of the context"
    );
    for (what, other) in [
        ("content", digest(&[Member::File("a", b"1", 0o644), Member::File("b", b"3", 0o644)], None)),
        ("mode", digest(&[Member::File("a", b"1", 0o600), Member::File("b", b"2", 0o644)], None)),
        ("uid", digest(&[Member::File("a", b"1", 0o644), Member::File("b", b"2", 0o644)], Some("1:0"))),
        ("gid", digest(&[Member::File("a", b"1", 0o644), Member::File("b", b"2", 0o644)], Some("0:1"))),
        ("name", digest(&[Member::File("a", b"1", 0o644), Member::File("c", b"2", 0o644)], None)),
        ("kind", digest(&[Member::File("a", b"1", 0o644), Member::Symlink("b", "2")], None)),
    ] {
        assert_ne!(base, other, "a change of {what} kept the digest");
    }
}
