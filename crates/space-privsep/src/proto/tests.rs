//! The request set's wire format and its checks.

use super::*;

const SBX: &str = "sbx_0123456789abcdef0123";

fn sandbox() -> SandboxId {
    SandboxId::parse(SBX).unwrap()
}

fn shape() -> Shape {
    Shape {
        memory_mib: MemoryMib::new(512).unwrap(),
        vcpus: Vcpus::new(1).unwrap(),
        disk_mib: DiskMib::new(1024).unwrap(),
    }
}

fn template() -> TemplateRef {
    TemplateRef { name: TemplateName::parse("base").unwrap(), version: TemplateVersion::new(3).unwrap() }
}

/// One of every request, for round trips and path checks.
/// One request of every kind (the layout's tests walk their paths too).
pub(crate) fn every_request() -> Vec<Request> {
    let image = ImageRef::Checkpoint { name: CheckpointName::parse("before-upgrade").unwrap() };
    let fork = ImageRef::Fork { operation: OperationId::parse("op_00112233445566778899").unwrap() };
    vec![
        Request::Hello { version: PROTOCOL_VERSION, engine: Engine::Gvisor },
        Request::Hello { version: PROTOCOL_VERSION, engine: Engine::Firecracker },
        Request::Start {
            sandbox: sandbox(),
            engine: Engine::Firecracker,
            from: StartFrom::Clone { template: template() },
            shape: shape(),
            mounts: vec![],
        },
        Request::Start {
            sandbox: sandbox(),
            engine: Engine::Gvisor,
            from: StartFrom::Template { template: template() },
            shape: shape(),
            mounts: vec![],
        },
        Request::Start {
            sandbox: sandbox(),
            engine: Engine::Firecracker,
            from: StartFrom::Suspended {},
            shape: shape(),
            mounts: vec![],
        },
        Request::Start {
            sandbox: sandbox(),
            engine: Engine::Gvisor,
            from: StartFrom::Image { source: sandbox(), image: fork.clone() },
            shape: shape(),
            mounts: vec![],
        },
        Request::Start {
            sandbox: sandbox(),
            engine: Engine::Gvisor,
            from: StartFrom::TemplateImage { template: template() },
            shape: shape(),
            mounts: vec![],
        },
        Request::Pause { sandbox: sandbox() },
        Request::Resume { sandbox: sandbox() },
        Request::Freeze { sandbox: sandbox(), frozen: true },
        Request::SetTimerSlack { sandbox: sandbox(), slack_ns: Some(SlackNs::new(50_000_000).unwrap()) },
        Request::SetTimerSlack { sandbox: sandbox(), slack_ns: None },
        Request::Suspend { sandbox: sandbox() },
        Request::SaveImage { sandbox: sandbox(), image: image.clone() },
        Request::DropImage { sandbox: sandbox(), image: fork },
        Request::SaveImage { sandbox: sandbox(), image: ImageRef::Template { template: template() } },
        Request::DropSnapshot { sandbox: sandbox() },
        Request::Stop { sandbox: sandbox() },
        Request::StopStrays { sandbox: sandbox() },
        Request::SettleOrphans { sandboxes: vec![sandbox()], patience_ms: PatienceMs::new(10_000).unwrap() },
        Request::States { sandboxes: vec![sandbox(), sandbox()] },
        Request::EngineLog { sandbox: sandbox() },
        Request::Kill { sandbox: sandbox(), signal: Signal::Kill },
        Request::Destroy { sandbox: sandbox() },
        Request::State { sandbox: sandbox() },
        Request::List {},
        Request::ListenAgent { sandbox: sandbox() },
        Request::CloseAgent { sandbox: sandbox() },
        Request::ConnectVmm { sandbox: sandbox() },
        Request::HasCloneBase { template: template(), shape: shape() },
        Request::SaveCloneBase { sandbox: sandbox(), template: template() },
        Request::BuildTemplate {
            template: template(),
            source: BuildSource::Debian {
                suite: Suite::parse("bookworm").unwrap(),
                packages: ["python3", "libstdc++6", "ca-certificates"]
                    .iter()
                    .map(|p| PackageName::parse(p).unwrap())
                    .collect(),
            },
            disk_mib: DiskMib::new(4096).unwrap(),
        },
        Request::BuildTemplate {
            template: template(),
            source: BuildSource::OciArchive {},
            disk_mib: DiskMib::new(4096).unwrap(),
        },
        Request::BeginTemplate { template: template() },
        Request::CopyCheckpoint {
            template: template(),
            sandbox: sandbox(),
            checkpoint: CheckpointName::parse("before-upgrade").unwrap(),
        },
        Request::PublishTemplate {
            template: template(),
            meta: TemplateMetaJson::parse(r#"{"name": "base", "version": 3}"#).unwrap(),
            ext4: Some(DiskMib::new(1024).unwrap()),
        },
        Request::DeleteTemplate { name: template().name, version: Some(template().version) },
        Request::DeleteTemplate { name: template().name, version: None },
        Request::ClearStaleQuotas {},
        Request::ExportTemplate { template: template() },
        Request::BuildTemplate {
            template: template(),
            source: BuildSource::Layers { top: chain() },
            disk_mib: DiskMib::new(4096).unwrap(),
        },
        Request::HasLayer { chain: chain() },
        Request::ApplyLayer { parent: None, layer: blob_key(), disk_mib: DiskMib::new(4096).unwrap() },
        Request::ApplyLayer {
            parent: Some(chain()),
            layer: LayerKey::Step { key: StepKey::parse(&"5".repeat(64)).unwrap() },
            disk_mib: DiskMib::new(4096).unwrap(),
        },
        Request::DeleteLayer { chain: chain() },
        Request::ListLayers {},
        Request::Start {
            sandbox: sandbox(),
            engine: Engine::Gvisor,
            from: StartFrom::Layer { chain: chain() },
            shape: shape(),
            mounts: vec![],
        },
        Request::SaveLayer { sandbox: sandbox(), parent: chain(), key: StepKey::parse(&"7".repeat(64)).unwrap() },
        Request::Start {
            sandbox: sandbox(),
            engine: Engine::Gvisor,
            from: StartFrom::Template { template: template() },
            shape: shape(),
            mounts: vec![mount(VOL, "/workspace", false), mount(OTHER_VOL, "/data/ro", true)],
        },
        Request::CreateVolume { volume: volume(), size: DiskMib::new(1024).unwrap(), from: None, image: false },
        Request::CreateVolume { volume: volume(), size: DiskMib::new(1024).unwrap(), from: None, image: true },
        Request::CreateVolume {
            volume: volume(),
            size: DiskMib::new(1024).unwrap(),
            from: Some((VolumeId::parse(OTHER_VOL).unwrap(), snapshot())),
            image: false,
        },
        Request::DeleteVolume { volume: volume() },
        Request::SnapshotVolume { volume: volume(), snapshot: snapshot() },
        Request::DeleteVolumeSnapshot { volume: volume(), snapshot: snapshot() },
        Request::RestoreVolume { volume: volume(), snapshot: snapshot() },
        Request::VolumeUsage { volume: volume() },
        Request::ListVolumes {},
        Request::VolumeFiles { volume: volume(), write: false },
        Request::VolumeFiles { volume: volume(), write: true },
        Request::VolumeStore {},
        Request::AttachVolume { volume: volume() },
        Request::DetachVolume { volume: volume() },
    ]
}

const VOL: &str = "vol_0123456789abcdef0123";
const OTHER_VOL: &str = "vol_fedcba9876543210fedc";

fn volume() -> VolumeId {
    VolumeId::parse(VOL).unwrap()
}

fn snapshot() -> SnapshotName {
    SnapshotName::parse("before-refactor").unwrap()
}

fn mount(volume: &str, path: &str, read_only: bool) -> Mount {
    Mount { volume: VolumeId::parse(volume).unwrap(), path: MountPath::parse(path).unwrap(), read_only }
}

fn chain() -> ChainId {
    ChainId::next(None, &blob_key())
}

fn blob_key() -> LayerKey {
    LayerKey::Blob {
        digest: BlobDigest::parse(&format!("sha256:{}", "ab".repeat(32))).unwrap(),
        diff_id: Some(BlobDigest::parse(&format!("sha256:{}", "cd".repeat(32))).unwrap()),
    }
}

fn body(frame: &[u8]) -> &[u8] {
    let len = body_len(frame[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(len, frame.len() - HEADER_LEN);
    &frame[HEADER_LEN..]
}

#[test]
fn every_request_round_trips_through_a_frame() {
    for request in every_request() {
        let frame = encode(&request).unwrap();
        assert_eq!(decode_request(body(&frame)).unwrap(), request);
    }
}

#[test]
fn replies_round_trip_and_say_what_they_carry() {
    let replies = [
        Reply::Hello { version: PROTOCOL_VERSION },
        Reply::Done {},
        Reply::Has { has: true },
        Reply::Started { pid: 42, steps: vec![StepTook { step: StartStep::RootSnapshot, micros: 1200 }] },
        Reply::SlackSet { tasks: 12 },
        Reply::ImageSaved { frozen_us: 25_000 },
        Reply::Listening {},
        Reply::Vmm {},
        Reply::State { state: EngineState::Paused },
        Reply::States { states: vec![EngineState::Running, EngineState::Missing] },
        Reply::Log { text: "runsc: started".into() },
        Reply::Sandboxes { sandboxes: vec![sandbox()] },
        Reply::Layers { layers: vec![LayerEntry { chain: chain(), bytes: 4096, used_s: 1_700_000_000 }] },
        Reply::refused(Refusal::Conflict, "that sandbox exists"),
        Reply::VolumeUsage { used_bytes: 4096, snapshots: vec![SnapshotUsage { snapshot: snapshot(), bytes: 16384 }] },
        Reply::Volumes { volumes: vec![VolumeEntry { volume: volume(), snapshots: vec![snapshot()] }] },
        Reply::VolumeFiles {},
        Reply::VolumeStore { store: Some("0123456789abcdef0123456789abcdef".into()) },
        Reply::VolumeStore { store: None },
    ];
    for reply in replies {
        let frame = encode(&reply).unwrap();
        assert_eq!(decode_reply(body(&frame)).unwrap(), reply);
    }
    assert_eq!(Reply::Started { pid: 1, steps: vec![] }.fds(), 1);
    let steps = vec![StepTook { step: StartStep::DiskLimit, micros: 1 }; MAX_STEPS + 1];
    assert!(decode_reply(&encode(&Reply::Started { pid: 1, steps }).unwrap()[HEADER_LEN..]).is_err());
    assert_eq!(Reply::Done {}.fds(), 0);
    assert_eq!(Reply::VolumeFiles {}.fds(), 1);
    let snapshots = vec![SnapshotUsage { snapshot: snapshot(), bytes: 1 }; MAX_VOLUME_SNAPSHOTS + 1];
    assert!(decode_reply(&encode(&Reply::VolumeUsage { used_bytes: 0, snapshots }).unwrap()[HEADER_LEN..]).is_err());
}

#[test]
fn a_mount_path_is_absolute_plain_and_nowhere_the_system_owns() {
    for good in ["/workspace", "/data/ro", "/home/user/work", "/procfs", "/tmpdir", "/.spacey", "/srv/..x", "/a b"] {
        assert_eq!(MountPath::parse(good).unwrap().as_str(), good);
    }
    let long_ok = format!("/{}", vec!["a".repeat(200); 20].join("/"));
    assert!(long_ok.len() <= MAX_MOUNT_PATH && MountPath::parse(&long_ok).is_ok());
    for (bad, why) in [
        ("/", "root"),
        ("", "absolute"),
        ("workspace", "absolute"),
        ("./workspace", "absolute"),
        ("/work/../etc", ".."),
        ("/..", ".."),
        ("/work/./x", "."),
        ("//work", "empty"),
        ("/work//x", "empty"),
        ("/work/", "empty"),
        ("/work\0x", "NUL"),
        ("/proc", "/proc"),
        ("/proc/1/root", "/proc"),
        ("/sys", "/sys"),
        ("/sys/fs", "/sys"),
        ("/dev", "/dev"),
        ("/dev/shm", "/dev"),
        ("/tmp", "/tmp"),
        ("/tmp/x", "/tmp"),
        ("/.space", "/.space"),
        ("/.space/space-agent", "/.space"),
        ("/.space/host", "/.space"),
    ] {
        match MountPath::parse(bad) {
            Err(ProtoError::Invalid(message)) => assert!(message.contains(why), "{bad:?}: {message}"),
            other => panic!("{bad:?} was not refused: {other:?}"),
        }
    }
    let too_long = format!("/{}", "a/".repeat(MAX_MOUNT_PATH / 2) + "a");
    assert!(MountPath::parse(&too_long).is_err());
    let long_name = format!("/{}", "a".repeat(256));
    assert!(MountPath::parse(&long_name).is_err());
    // A path in a request is checked as it parses, not only when made here.
    let start = |path: &str| {
        format!(
            r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"template","template":{{"name":"base","version":1}}}},"shape":{{"memory_mib":512,"vcpus":1,"disk_mib":1024}},"mounts":[{{"volume":"{VOL}","path":"{path}","read_only":false}}]}}"#
        )
    };
    assert!(decode_request(start("/workspace").as_bytes()).is_ok());
    for bad in ["/", "/proc", "relative", "/a/../b", "/.space/host"] {
        assert!(decode_request(start(bad).as_bytes()).is_err(), "{bad}");
    }
}

#[test]
fn a_sandboxs_mounts_are_bounded_and_never_meet() {
    let start = |mounts: Vec<Mount>| Request::Start {
        sandbox: sandbox(),
        engine: Engine::Gvisor,
        from: StartFrom::Template { template: template() },
        shape: shape(),
        mounts,
    };
    let round = |request: &Request| decode_request(body(&encode(request).unwrap()));
    let ok = start(vec![mount(VOL, "/a", false), mount(VOL, "/ab", true), mount(OTHER_VOL, "/b/c", true)]);
    assert!(round(&ok).is_ok());
    for (mounts, why) in [
        (vec![mount(VOL, "/work", false), mount(OTHER_VOL, "/work", true)], "two volumes"),
        (vec![mount(VOL, "/work", false), mount(OTHER_VOL, "/work/sub", true)], "under"),
        (vec![mount(VOL, "/work/sub/deeper", false), mount(OTHER_VOL, "/work", true)], "under"),
    ] {
        match round(&start(mounts)) {
            Err(ProtoError::Invalid(message)) => assert!(message.contains(why), "{message}"),
            other => panic!("not refused: {other:?}"),
        }
    }
    let many: Vec<Mount> = (0..=MAX_MOUNTS).map(|i| mount(VOL, &format!("/m{i}"), true)).collect();
    assert!(round(&start(many[..MAX_MOUNTS].to_vec())).is_ok());
    assert!(matches!(round(&start(many)), Err(ProtoError::Invalid(m)) if m.contains("over")));
    // A volume made from its own snapshot is refused; ids and names keep their rules.
    let own = Request::CreateVolume {
        volume: volume(),
        size: DiskMib::new(1).unwrap(),
        from: Some((volume(), snapshot())),
        image: false,
    };
    assert!(round(&own).is_err());
    // A volume from a snapshot is of its source's kind: it names no image.
    let from = Some((VolumeId::parse(OTHER_VOL).unwrap(), snapshot()));
    let image_from = Request::CreateVolume { volume: volume(), size: DiskMib::new(1).unwrap(), from, image: true };
    assert!(matches!(round(&image_from), Err(ProtoError::Invalid(m)) if m.contains("source's kind")));
    // An old client's request (no `image`) is a directory volume.
    let old = serde_json::from_str::<Request>(
        r#"{"op":"create_volume","volume":"vol_0123456789abcdef0123","size":8,"from":null}"#,
    );
    assert!(matches!(old, Ok(Request::CreateVolume { image: false, .. })), "{old:?}");
    assert!(matches!(
        hostile(r#"{"op":"snapshot_volume","volume":"vol_../../etc","snapshot":"x"}"#),
        ProtoError::Malformed(_)
    ));
    assert!(matches!(
        hostile(r#"{"op":"snapshot_volume","volume":"vol_0123456789abcdef0123","snapshot":"../x"}"#),
        ProtoError::Malformed(_)
    ));
    assert!(matches!(
        hostile(r#"{"op":"create_volume","volume":"vol_0123456789abcdef0123","size":0,"from":null}"#),
        ProtoError::Malformed(_)
    ));
}

#[test]
fn a_refusal_message_is_cut_to_its_bound() {
    let Reply::Refused { message, .. } = Reply::refused(Refusal::Failed, "é".repeat(MAX_MESSAGE)) else {
        panic!("not a refusal")
    };
    assert!(message.len() <= MAX_MESSAGE && message.len() > MAX_MESSAGE - 2);
}

#[test]
fn frames_past_the_limit_or_empty_are_refused_before_their_body() {
    assert!(matches!(body_len((MAX_FRAME as u32 + 1).to_be_bytes()), Err(ProtoError::TooLarge(_))));
    assert!(matches!(body_len(u32::MAX.to_be_bytes()), Err(ProtoError::TooLarge(_))));
    assert!(matches!(body_len([0; 4]), Err(ProtoError::Empty)));
    assert_eq!(body_len((MAX_FRAME as u32).to_be_bytes()).unwrap(), MAX_FRAME);
    let huge = vec![b' '; MAX_FRAME + 1];
    assert!(matches!(decode_request(&huge), Err(ProtoError::TooLarge(_))));
    let packages = (0..20_000).map(|i| PackageName::parse(&format!("package-number-{i}")).unwrap()).collect();
    let request = Request::BuildTemplate {
        template: template(),
        source: BuildSource::Debian { suite: Suite::parse("bookworm").unwrap(), packages },
        disk_mib: DiskMib::new(1).unwrap(),
    };
    assert!(matches!(encode(&request), Err(ProtoError::TooLarge(_))));
}

#[test]
fn malformed_json_is_refused_with_what_was_wrong() {
    for bad in [
        &b"{"[..],
        b"null",
        b"[]",
        b"{\"op\":\"pause\"}",
        b"{\"op\":\"reboot\"}",
        b"{\"op\":\"list\",\"path\":\"/\"}",
        b"\xff\xfe",
    ] {
        let err = decode_request(bad).unwrap_err();
        assert!(matches!(err, ProtoError::Malformed(_)), "{bad:?}: {err}");
        assert!(err.to_string().starts_with("a malformed message: "), "{err}");
    }
}

/// A hostile request in JSON, as a compromised unprivileged process
/// would write it.
fn hostile(json: &str) -> ProtoError {
    match decode_request(json.as_bytes()) {
        Ok(request) => panic!("accepted {json}: {request:?}"),
        Err(err) => err,
    }
}

#[test]
fn ids_in_any_but_their_canonical_spelling_are_refused() {
    for id in [
        "../sbx_0123456789abcdef0123",
        "sbx_0123456789abcdef0123/..",
        "sbx_0123456789abcdef0123/../../etc",
        "sbx_../../../../etc/passwd",
        "sbx_0123456789ABCDEF0123",
        "SBX_0123456789abcdef0123",
        "sbx_0123456789abcdef012",
        "sbx_0123456789abcdef01234",
        " sbx_0123456789abcdef0123",
        "sbx_0123456789abcdef0123\u{0}",
        "%73bx_0123456789abcdef0123",
        "/var/lib/other-space/sandboxes/sbx_0123456789abcdef0123",
        "op_0123456789abcdef01234",
        "",
    ] {
        let json = serde_json::json!({"op": "destroy", "sandbox": id}).to_string();
        let err = hostile(&json);
        assert!(err.to_string().contains("not a sandbox id"), "{id:?}: {err}");
    }
}

#[test]
fn names_and_images_cannot_climb_out_of_their_directory() {
    for json in [
        r#"{"op":"delete_template","name":"..","version":1}"#,
        r#"{"op":"delete_template","name":"base/../../..","version":1}"#,
        r#"{"op":"delete_template","name":"/etc","version":1}"#,
        r#"{"op":"delete_template","name":".1.partial","version":1}"#,
        r#"{"op":"drop_image","sandbox":"sbx_0123456789abcdef0123","image":{"kind":"checkpoint","name":"../../sbx_99999999999999999999"}}"#,
        r#"{"op":"drop_image","sandbox":"sbx_0123456789abcdef0123","image":{"kind":"fork","operation":"op_../../x"}}"#,
        r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"image","source":"sbx_0123456789abcdef0123/../..","image":{"kind":"fork","operation":"op_00112233445566778899"}},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024}}"#,
    ] {
        let err = hostile(json);
        assert!(matches!(err, ProtoError::Malformed(_)) && err.to_string().contains("not a"), "{json}: {err}");
    }
}

#[test]
fn a_path_cannot_be_written_into_any_request() {
    // Every field that could carry one is a typed id; a field of
    // another name is refused, whatever it holds.
    for json in [
        r#"{"op":"destroy","sandbox":"sbx_0123456789abcdef0123","dir":"/var/lib/other"}"#,
        r#"{"op":"destroy","sandbox":"sbx_0123456789abcdef0123","data_dir":"/"}"#,
        r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"template","template":{"name":"base","version":1}},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024},"bundle":"/tmp/evil"}"#,
        r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"path","path":"/"},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024}}"#,
        r#"{"op":"build_template","template":{"name":"x","version":1},"source":{"kind":"directory","path":"/etc"},"disk_mib":10}"#,
        r#"{"op":"build_template","template":{"name":"x","version":1},"source":{"kind":"oci_archive","path":"/etc/shadow"},"disk_mib":10}"#,
        r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"suspended","dir":"/"},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024}}"#,
        r#"{"op":"list","under":"/var/lib/other"}"#,
    ] {
        assert!(matches!(hostile(json), ProtoError::Malformed(_)), "{json}");
    }
}

#[test]
fn sizes_out_of_bounds_are_refused() {
    let start = |memory: u64, vcpus: u64, disk: u64| {
        format!(
            r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"suspended"}},"shape":{{"memory_mib":{memory},"vcpus":{vcpus},"disk_mib":{disk}}}}}"#
        )
    };
    assert!(decode_request(start(512, 2, 1024).as_bytes()).is_ok());
    for (memory, vcpus, disk) in [
        (0, 1, 1),
        (63, 1, 1),
        ((1 << 20) + 1, 1, 1),
        (u32::MAX as u64, 1, 1),
        (1 << 40, 1, 1),
        (512, 0, 1),
        (512, 257, 1),
        (512, 1, 0),
        (512, 1, (16 << 20) + 1),
    ] {
        let json = start(memory, vcpus, disk);
        let err = hostile(&json);
        assert!(err.to_string().contains("outside") || err.to_string().contains("invalid value"), "{json}: {err}");
    }
    for json in [
        format!(
            r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"suspended"}},"shape":{{"memory_mib":-1,"vcpus":1,"disk_mib":1}}}}"#
        ),
        format!(
            r#"{{"op":"start","sandbox":"{SBX}","engine":"gvisor","from":{{"kind":"suspended"}},"shape":{{"memory_mib":512.5,"vcpus":1,"disk_mib":1}}}}"#
        ),
        format!(r#"{{"op":"set_timer_slack","sandbox":"{SBX}","slack_ns":1000000001}}"#),
        format!(r#"{{"op":"set_timer_slack","sandbox":"{SBX}","slack_ns":0}}"#),
        r#"{"op":"publish_template","template":{"name":"base","version":0}}"#.to_string(),
        r#"{"op":"publish_template","template":{"name":"base","version":4294967296}}"#.to_string(),
    ] {
        hostile(&json);
    }
}

#[test]
fn package_lists_are_bounded_and_hold_package_names_only() {
    let build = |packages: &str| {
        format!(
            r#"{{"op":"build_template","template":{{"name":"py","version":1}},"source":{{"kind":"debian","suite":"bookworm","packages":[{packages}]}},"disk_mib":100}}"#
        )
    };
    assert!(decode_request(build(r#""python3""#).as_bytes()).is_ok());
    let many = (0..=MAX_PACKAGES).map(|i| format!("\"p{i}\"")).collect::<Vec<_>>().join(",");
    for packages in
        ["", r#""python3","python3""#, &many, r#""--allow-unauthenticated""#, r#""a b""#, r#""pkg;rm -rf /""#]
    {
        hostile(&build(packages));
    }
    for suite in ["../../etc", "bookworm main", "-o", ""] {
        let json = format!(
            r#"{{"op":"build_template","template":{{"name":"py","version":1}},"source":{{"kind":"debian","suite":"{suite}","packages":["python3"]}},"disk_mib":100}}"#
        );
        hostile(&json);
    }
}

#[test]
fn a_hello_in_another_version_is_refused() {
    assert!(decode_request(br#"{"op":"hello","version":4,"engine":"firecracker"}"#).is_ok());
    let err = hostile(r#"{"op":"hello","version":3,"engine":"gvisor"}"#);
    assert!(err.to_string().contains("protocol version 3"), "{err}");
    // Every connection says which engine's sandboxes it is about.
    assert!(decode_request(br#"{"op":"hello","version":3}"#).is_err());
}

#[test]
fn a_refused_text_is_not_echoed_whole() {
    let long = format!("sbx_{}", "a".repeat(10_000));
    let err = SandboxId::parse(&long).unwrap_err().to_string();
    assert!(err.len() < 200, "{err}");
}

#[test]
fn a_build_carries_its_log_and_archive_and_nothing_else_carries_a_descriptor() {
    for request in every_request() {
        let expected = match request {
            Request::BuildTemplate { source: BuildSource::OciArchive {} | BuildSource::RootTar {}, .. }
            | Request::ApplyLayer { .. } => 2,
            Request::BuildTemplate { source: BuildSource::Debian { .. } | BuildSource::Layers { .. }, .. }
            | Request::ExportTemplate { .. } => 1,
            _ => 0,
        };
        assert_eq!(request.fds(), expected, "{request:?}");
        assert!(request.fds() <= MAX_FDS);
    }
}

#[test]
fn a_template_record_is_one_bounded_json_object() {
    assert!(TemplateMetaJson::parse(r#"{"name": "base"}"#).is_ok());
    for refused in ["[1, 2]", "\"base\"", "{", ""] {
        assert!(TemplateMetaJson::parse(refused).is_err(), "{refused:?}");
    }
    let huge = format!(r#"{{"name": "{}"}}"#, "a".repeat(MAX_TEMPLATE_META));
    assert!(TemplateMetaJson::parse(&huge).is_err());
    let body = format!(
        r#"{{"op": "publish_template", "template": {{"name": "base", "version": 3}}, "meta": {}}}"#,
        serde_json::to_string(&huge).unwrap()
    );
    assert!(decode_request(body.as_bytes()).is_err());
}

#[test]
fn a_chain_id_is_the_hash_of_its_parent_and_its_layer_and_nothing_else() {
    // Fixed (`printf "\nblob sha256:abab…" | sha256sum`): a change to the
    // spelling would strand every cached chain.
    let first = ChainId::next(None, &blob_key());
    assert_eq!(first.as_str(), "700da283d8d99f43c2c8296fbfd4f77ed9f558377c199969c2d726df45103030");
    // diff_id is checked, not hashed: the blob's digest names the layer.
    let LayerKey::Blob { digest, .. } = blob_key() else { unreachable!() };
    assert_eq!(ChainId::next(None, &LayerKey::Blob { digest, diff_id: None }), first);
    let second = ChainId::next(Some(&first), &blob_key());
    assert_ne!(second, first);
    let step = LayerKey::Step { key: StepKey::parse(&"ab".repeat(32)).unwrap() };
    assert_ne!(ChainId::next(None, &step), first, "a step never meets a blob of the same hex");
}

#[test]
fn layer_ids_and_digests_in_any_other_spelling_are_refused() {
    for json in [
        r#"{"op":"has_layer","chain":"../../etc"}"#,
        r#"{"op":"has_layer","chain":"ABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABAB"}"#,
        r#"{"op":"delete_layer","chain":"abab"}"#,
        r#"{"op":"apply_layer","parent":null,"layer":{"kind":"blob","digest":"sha512:ab","diff_id":null},"disk_mib":10}"#,
        r#"{"op":"apply_layer","parent":null,"layer":{"kind":"blob","digest":"sha256:../x","diff_id":null},"disk_mib":10}"#,
        r#"{"op":"apply_layer","parent":null,"layer":{"kind":"step","key":"x"},"disk_mib":10}"#,
        r#"{"op":"apply_layer","parent":null,"layer":{"kind":"blob","digest":"sha256:aa","diff_id":null,"path":"/"},"disk_mib":10}"#,
        r#"{"op":"apply_layer","parent":null,"layer":{"kind":"blob","digest":"sha256:aa","diff_id":null},"disk_mib":0}"#,
    ] {
        hostile(json);
    }
    // A saved layer's parent and key in their one spelling, and nothing
    // beside them (no path, no chain id of the helper's to take).
    for json in [
        r#"{"op":"save_layer","sandbox":"sbx_0123456789abcdef0123","parent":"../x","key":"aa"}"#,
        r#"{"op":"start","sandbox":"sbx_0123456789abcdef0123","engine":"gvisor","from":{"kind":"layer","chain":"/etc"},"shape":{"memory_mib":512,"vcpus":1,"disk_mib":1024}}"#,
    ] {
        hostile(json);
    }
    let save = format!(
        r#"{{"op":"save_layer","sandbox":"sbx_0123456789abcdef0123","parent":"{0}","key":"{0}","chain":"{0}"}}"#,
        "a".repeat(64)
    );
    hostile(&save);
    assert!(decode_request(save.replace(&format!(r#","chain":"{}""#, "a".repeat(64)), "").as_bytes()).is_ok());
    let good = format!(
        r#"{{"op":"apply_layer","parent":null,"layer":{{"kind":"blob","digest":"sha256:{}","diff_id":null}},"disk_mib":10}}"#,
        "a".repeat(64)
    );
    assert!(decode_request(good.as_bytes()).is_ok());
}

#[test]
fn the_fuzz_seeds_of_volume_requests_decode() {
    let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/privsep_request");
    for seed in ["start_mounts.json", "create_volume.json", "restore_volume.json", "volume_files.json"] {
        let body = std::fs::read(seeds.join(seed)).unwrap();
        decode_request(&body).unwrap_or_else(|err| panic!("{seed}: {err}"));
    }
}
