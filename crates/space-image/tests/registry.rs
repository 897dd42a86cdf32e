//! The registry client against a real registry on loopback (Debian's
//! `docker-registry`, images pushed by `skopeo` from layouts the tests
//! write), and against fake registries (axum on loopback) for what a real
//! one never does: huge manifests, hostile redirects, token services on
//! other hosts.

mod fake;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::Response;
use serde_json::json;
use sha2::{Digest, Sha256};
use space_image::{Client, Compression, Credential, ImageError, ImageRef, RegistryConfig, ResolvedImage};
use space_testkit::oci_layout::{self, Image, Layer, Member, PushFormat, Written};
use space_testkit::registry::{Registry, ScratchDir, TEST_PASSWORD, TEST_USER};
use space_testkit::PATIENCE;
use zeroize::Zeroizing;

/// `f` within the tests' patience.
async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f).await.unwrap_or_else(|_| panic!("{what} took longer than {PATIENCE:?}"))
}

fn config(insecure: &[&str]) -> RegistryConfig {
    RegistryConfig {
        insecure: insecure.iter().map(|s| s.to_string()).collect(),
        user_agent: "space-image-test".into(),
        ..RegistryConfig::default()
    }
}

fn credential(user: &str, password: &str, hosts: &[&str]) -> Credential {
    Credential {
        username: Some(user.into()),
        value: Zeroizing::new(password.into()),
        hosts: hosts.iter().map(|s| s.to_string()).collect(),
    }
}

fn reference(text: &str, config: &RegistryConfig) -> ImageRef {
    ImageRef::parse(text, config).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn sha256_file(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    format!("sha256:{:x}", Sha256::digest(&bytes))
}

/// Writes `images` as a layout and pushes it as `repo:tag`.
fn push(registry: &Registry, repo: &str, tag: &str, images: &[Image], format: PushFormat, auth: bool) -> Written {
    let dir = ScratchDir::new("layout");
    let written = oci_layout::write(&dir, tag, images);
    let creds = auth.then_some((TEST_USER, TEST_PASSWORD));
    oci_layout::push(&dir, tag, &registry.host, repo, creds, format);
    written
}

/// A three-layer image: gzip (files, a dir, a symlink), plain (a whiteout
/// and an opaque dir), zstd.
fn layered_image() -> Image {
    let mut image = Image::amd64(vec![
        Layer::new(
            oci_layout::Compression::Gzip,
            vec![
                Member::dir("etc"),
                Member::file("etc/motd", "hello from a registry\n"),
                Member::dir("app"),
                Member::file("app/old", "to be deleted"),
                Member::dir("cache"),
                Member::file("cache/a", "lower"),
                Member::Symlink { path: "app/link".into(), target: "old".into() },
            ],
        ),
        Layer::new(
            oci_layout::Compression::None,
            vec![
                Member::Whiteout { path: "app/old".into() },
                Member::Opaque { dir: "cache".into() },
                Member::file("cache/b", "upper"),
            ],
        ),
        Layer::new(oci_layout::Compression::Zstd, vec![Member::file("app/zstd", "compressed with zstd")]),
    ]);
    image.run_config = json!({
        "Env": ["PATH=/usr/bin:/bin", "GREETING=hi"],
        "WorkingDir": "/app",
        "User": "1000:1000",
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["echo hi"],
        "ExposedPorts": {"8080/tcp": {}},
        "Labels": {"team": "space"},
    });
    image
}

/// Downloads every layer of `image` into a new directory and checks each
/// file's digest; returns the directory.
async fn download_all(client: &Client, image: &ResolvedImage) -> ScratchDir {
    let dir = ScratchDir::new("blobs");
    for layer in &image.layers {
        let dest = dir.join(layer.digest.trim_start_matches("sha256:"));
        let mut seen = 0;
        bounded("a download", client.download_blob(image, layer, &dest, &mut |bytes| seen = bytes))
            .await
            .unwrap_or_else(|e| panic!("downloading {}: {e}", layer.digest));
        assert_eq!(seen, layer.size, "progress reached the layer's size");
        assert_eq!(sha256_file(&dest), layer.digest);
        assert!(!partial(&dest).exists());
    }
    dir
}

fn partial(dest: &Path) -> PathBuf {
    PathBuf::from(format!("{}.partial", dest.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_pull_resolves_the_manifest_and_config_and_downloads_verified_layers() {
    let registry = Registry::start(None);
    let written = push(&registry, "team/app", "1.0", &[layered_image()], PushFormat::Oci, false);
    let config = config(&[&registry.host]);
    let client = Client::new(&config).unwrap();
    let image =
        bounded("resolve", client.resolve(&reference(&format!("{}/team/app:1.0", registry.host), &config), None))
            .await
            .unwrap();

    let pushed = &written.images[0];
    assert_eq!(image.manifest_digest, pushed.manifest_digest);
    assert_eq!(image.index_digest, None);
    let layers: Vec<(String, u64)> = image.layers.iter().map(|l| (l.digest.clone(), l.size)).collect();
    assert_eq!(layers, pushed.layers);
    let compressions: Vec<Compression> = image.layers.iter().map(|l| l.compression).collect();
    assert_eq!(compressions, vec![Compression::Gzip, Compression::None, Compression::Zstd]);
    assert_eq!(image.layers[2].media_type, "application/vnd.oci.image.layer.v1.tar+zstd");
    assert_eq!(image.diff_ids, pushed.diff_ids);
    assert_eq!(image.total_bytes, pushed.layers.iter().map(|(_, size)| size).sum::<u64>());
    assert_eq!(image.config.env, vec!["PATH=/usr/bin:/bin", "GREETING=hi"]);
    assert_eq!(image.config.working_dir.as_deref(), Some("/app"));
    assert_eq!(image.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(image.config.entrypoint, vec!["/bin/sh", "-c"]);
    assert_eq!(image.config.cmd, vec!["echo hi"]);
    assert_eq!(image.config.exposed_ports, vec!["8080/tcp"]);
    assert_eq!(image.config.labels.get("team").map(String::as_str), Some("space"));

    let dir = download_all(&client, &image).await;
    // The zstd blob arrived as pushed: still zstd, and its tar is the diff_id's.
    let zstd_blob = std::fs::read(dir.join(image.layers[2].digest.trim_start_matches("sha256:"))).unwrap();
    let tar = zstd::stream::decode_all(zstd_blob.as_slice()).expect("a zstd frame");
    assert_eq!(format!("sha256:{:x}", Sha256::digest(&tar)), image.diff_ids[2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn htpasswd_basic_auth_needs_the_credential_and_refuses_a_wrong_password() {
    let auth = Some((TEST_USER, TEST_PASSWORD));
    let registry = Registry::start(auth);
    push(&registry, "private/app", "v1", &[layered_image()], PushFormat::Oci, true);
    let config = config(&[&registry.host]);
    let target = reference(&format!("{}/private/app:v1", registry.host), &config);

    let client = Client::new(&config).unwrap();
    let err = bounded("resolve", client.resolve(&target, None)).await.unwrap_err();
    assert!(matches!(err, ImageError::AuthFailed(_)), "{err}");
    assert!(err.is_input_error());

    let wrong = credential(TEST_USER, "not-the-password", &["127.0.0.1"]);
    let err = bounded("resolve", Client::new(&config).unwrap().resolve(&target, Some(&wrong))).await.unwrap_err();
    assert!(matches!(err, ImageError::AuthFailed(_)), "{err}");
    assert!(!err.to_string().contains("not-the-password"), "{err}");

    // A credential whose hosts do not cover the registry is not sent.
    let elsewhere = credential(TEST_USER, TEST_PASSWORD, &["registry.test"]);
    let err = bounded("resolve", Client::new(&config).unwrap().resolve(&target, Some(&elsewhere))).await.unwrap_err();
    assert!(matches!(err, ImageError::Refused(_)) && err.to_string().contains("127.0.0.1"), "{err}");

    let right = credential(TEST_USER, TEST_PASSWORD, &["127.0.0.1"]);
    let client = Client::new(&config).unwrap();
    let image = bounded("resolve", client.resolve(&target, Some(&right))).await.unwrap();
    assert_eq!(image.layers.len(), 3);
    download_all(&client, &image).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tags_repositories_and_pins_are_not_found_and_a_pin_is_checked() {
    let registry = Registry::start(None);
    let written = push(&registry, "team/app", "1.0", &[layered_image()], PushFormat::Oci, false);
    let config = config(&[&registry.host]);
    let client = Client::new(&config).unwrap();
    let host = &registry.host;
    let missing = [
        format!("{host}/team/app:2.0"),
        format!("{host}/team/nothing:1.0"),
        format!("{host}/team/app@sha256:{}", "0".repeat(64)),
    ];
    for text in &missing {
        let err = bounded("resolve", client.resolve(&reference(text, &config), None)).await.unwrap_err();
        assert!(matches!(err, ImageError::NotFound(_)), "{text}: {err}");
        assert!(err.is_input_error());
    }

    let digest = &written.images[0].manifest_digest;
    let pinned = reference(&format!("{host}/team/app@{digest}"), &config);
    let image = bounded("resolve", client.resolve(&pinned, None)).await.unwrap();
    assert_eq!(&image.manifest_digest, digest);
    // A tag and a pin: the pin is what is pulled.
    let both = reference(&format!("{host}/team/app:no-such-tag@{digest}"), &config);
    assert_eq!(&bounded("resolve", client.resolve(&both, None)).await.unwrap().manifest_digest, digest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_of_two_platforms_resolves_to_amd64() {
    let registry = Registry::start(None);
    let platform_image = |arch: &str| Image {
        architecture: arch.into(),
        layers: vec![Layer::new(
            oci_layout::Compression::Gzip,
            vec![Member::file("platform", arch), Member::file(&format!("only-on-{arch}"), "")],
        )],
        run_config: json!({ "Env": [format!("ARCH={arch}")] }),
    };
    let written =
        push(&registry, "multi", "latest", &[platform_image("arm64"), platform_image("amd64")], PushFormat::Oci, false);
    let config = config(&[&registry.host]);
    let client = Client::new(&config).unwrap();
    let image = bounded("resolve", client.resolve(&reference(&format!("{}/multi", registry.host), &config), None))
        .await
        .unwrap();
    let amd64 = written.images.iter().find(|i| i.architecture == "amd64").unwrap();
    assert_eq!(image.manifest_digest, amd64.manifest_digest);
    assert_eq!(image.index_digest, written.index_digest);
    assert_eq!(image.layers[0].digest, amd64.layers[0].0);
    assert_eq!(image.config.env, vec!["ARCH=amd64"]);

    // Pinned to the index: its digest is checked, then amd64 chosen.
    let index = written.index_digest.clone().unwrap();
    let pinned = reference(&format!("{}/multi@{index}", registry.host), &config);
    let image = bounded("resolve", client.resolve(&pinned, None)).await.unwrap();
    assert_eq!(
        (image.manifest_digest.as_str(), image.index_digest.as_deref()),
        (amd64.manifest_digest.as_str(), Some(index.as_str()))
    );

    // No amd64 in the index, or an arm64 image alone: no platform.
    push(&registry, "arm", "both", &[platform_image("arm64"), platform_image("riscv64")], PushFormat::Oci, false);
    push(&registry, "arm", "alone", &[platform_image("arm64")], PushFormat::Oci, false);
    for tag in ["both", "alone"] {
        let text = format!("{}/arm:{tag}", registry.host);
        let err = bounded("resolve", client.resolve(&reference(&text, &config), None)).await.unwrap_err();
        assert!(matches!(err, ImageError::NoPlatform(_)) && err.to_string().contains("arm64"), "{tag}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_docker_schema_2_manifest_resolves_and_downloads() {
    let registry = Registry::start(None);
    let image = Image::amd64(vec![
        Layer::new(oci_layout::Compression::Gzip, vec![Member::file("one", "1")]),
        Layer::new(oci_layout::Compression::Gzip, vec![Member::file("two", "2")]),
    ]);
    let written = push(&registry, "docker/app", "v2s2", &[image], PushFormat::DockerV2s2, false);
    let raw = oci_layout::inspect_raw(&registry.host, "docker/app", "v2s2", None);
    assert_eq!(raw["mediaType"], "application/vnd.docker.distribution.manifest.v2+json", "{raw}");

    let config = config(&[&registry.host]);
    let client = Client::new(&config).unwrap();
    let target = reference(&format!("{}/docker/app:v2s2", registry.host), &config);
    let image = bounded("resolve", client.resolve(&target, None)).await.unwrap();
    for layer in &image.layers {
        assert_eq!(layer.media_type, "application/vnd.docker.image.rootfs.diff.tar.gzip");
        assert_eq!(layer.compression, Compression::Gzip);
    }
    let layers: Vec<(String, u64)> = image.layers.iter().map(|l| (l.digest.clone(), l.size)).collect();
    assert_eq!(layers, written.images[0].layers, "the blobs are the layout's");
    assert_ne!(image.manifest_digest, written.images[0].manifest_digest, "the manifest was converted");
    download_all(&client, &image).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_blob_is_a_digest_mismatch_and_leaves_no_file() {
    let registry = Registry::start(None);
    let written = push(&registry, "team/app", "1.0", &[layered_image()], PushFormat::Oci, false);
    let (digest, _) = &written.images[0].layers[0];
    let data = registry.blob_data(digest);
    let mut bytes = std::fs::read(&data).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&data, &bytes).unwrap();

    let config = config(&[&registry.host]);
    let client = Client::new(&config).unwrap();
    let image =
        bounded("resolve", client.resolve(&reference(&format!("{}/team/app:1.0", registry.host), &config), None))
            .await
            .unwrap();
    let dir = ScratchDir::new("blobs");
    let dest = dir.join("blob");
    let err =
        bounded("a download", client.download_blob(&image, &image.layers[0], &dest, &mut |_| {})).await.unwrap_err();
    assert!(matches!(&err, ImageError::DigestMismatch { expected, .. } if expected == digest), "{err}");
    assert!(!dest.exists() && !partial(&dest).exists(), "nothing is left of a blob that did not verify");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // The other layers still download.
    client.download_blob(&image, &image.layers[1], &dest, &mut |_| {}).await.unwrap();
}

#[test]
fn a_reference_without_a_host_needs_a_default_registry() {
    let err = ImageRef::parse("debian:bookworm-slim", &config(&[])).unwrap_err();
    assert!(matches!(err, ImageError::InvalidReference(_)) && err.is_input_error(), "{err}");
    let with_default = RegistryConfig { default_registry: Some("registry.test".into()), ..config(&[]) };
    let parsed = ImageRef::parse("debian:bookworm-slim", &with_default).unwrap();
    assert_eq!(parsed.to_string(), "registry.test/debian:bookworm-slim");
}

const MIB: usize = 1 << 20;
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// A body of `total` spaces sent 64 KiB at a time, stalling for good after
/// `stall_at` bytes (a client that reads to the end never gets there);
/// what it sent is counted in `sent`.
fn spaces(total: usize, stall_at: usize, sent: Arc<AtomicUsize>) -> Body {
    const CHUNK: usize = 64 << 10;
    let stream = futures_util::stream::unfold(0usize, move |so_far| {
        let sent = sent.clone();
        async move {
            if so_far >= stall_at {
                std::future::pending::<()>().await;
            }
            if so_far >= total {
                return None;
            }
            let chunk = CHUNK.min(total - so_far);
            sent.fetch_add(chunk, Ordering::SeqCst);
            Some((Ok::<_, std::io::Error>(Bytes::from(vec![b' '; chunk])), so_far + chunk))
        }
    });
    Body::from_stream(stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_past_8_mib_is_refused_while_it_arrives() {
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    // 20 MiB, stalling after 12: only a client that stops at its bound
    // finishes; one that buffers the whole body waits forever.
    let fake = fake::serve(move |request| {
        let path = request.uri().path();
        if !path.contains("/manifests/") {
            return fake::FakeImage::new().answer(path);
        }
        let mut response = Response::builder().header(header::CONTENT_TYPE, OCI_MANIFEST);
        if path.contains("/declared/") {
            response = response.header(header::CONTENT_LENGTH, 20 * MIB);
        }
        response.body(spaces(20 * MIB, 12 * MIB, counter.clone())).unwrap()
    })
    .await;
    let config = config(&[&fake.host]);
    let client = Client::new(&config).unwrap();
    for repo in ["streamed", "declared"] {
        sent.store(0, Ordering::SeqCst);
        let target = reference(&format!("{}/{repo}/app:1", fake.host), &config);
        let err = bounded("resolve", client.resolve(&target, None)).await.unwrap_err();
        assert!(matches!(err, ImageError::TooLarge { limit, .. } if limit == 8 << 20), "{repo}: {err}");
        assert!(sent.load(Ordering::SeqCst) <= 12 * MIB);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_digest_is_checked_against_the_manifest_bytes() {
    let image = fake::FakeImage::new();
    let manifest = image.manifest.clone();
    // Serves its manifest whatever digest it is asked for.
    let fake = fake::serve(move |request| {
        let path = request.uri().path();
        match path.contains("/manifests/") {
            true => fake::respond(StatusCode::OK, OCI_MANIFEST, manifest.clone()),
            false => fake::FakeImage::new().answer(path),
        }
    })
    .await;
    let config = config(&[&fake.host]);
    let client = Client::new(&config).unwrap();
    let right = reference(&format!("{}/app@{}", fake.host, image.manifest_digest), &config);
    assert_eq!(bounded("resolve", client.resolve(&right, None)).await.unwrap().manifest_digest, image.manifest_digest);
    let wrong_pin = format!("sha256:{}", "e".repeat(64));
    let wrong = reference(&format!("{}/app@{wrong_pin}", fake.host), &config);
    let err = bounded("resolve", client.resolve(&wrong, None)).await.unwrap_err();
    assert!(
        matches!(&err, ImageError::DigestMismatch { expected, actual, .. }
            if *expected == wrong_pin && *actual == image.manifest_digest),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_longer_than_its_descriptor_is_cut_off_and_leaves_no_file() {
    let image = fake::FakeImage::new();
    let layer_path = format!("/blobs/{}", image.layer_digest);
    let layer_size = image.layer.len();
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    let fake = fake::serve(move |request| {
        let path = request.uri().path();
        match path.ends_with(&layer_path) {
            // No length announced: the excess is seen only while streaming.
            true => Response::new(spaces(layer_size + 4 * MIB, usize::MAX, counter.clone())),
            false => fake::FakeImage::new().answer(path),
        }
    })
    .await;
    let config = config(&[&fake.host]);
    let client = Client::new(&config).unwrap();
    let resolved =
        bounded("resolve", client.resolve(&reference(&format!("{}/app:1", fake.host), &config), None)).await.unwrap();
    let dir = ScratchDir::new("blobs");
    let dest = dir.join("blob");
    let err = bounded("a download", client.download_blob(&resolved, &resolved.layers[0], &dest, &mut |_| {}))
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::TooLarge { limit, .. } if limit == layer_size as u64), "{err}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no file is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_tokens_come_only_from_a_token_service_within_the_credentials_hosts_and_are_renewed() {
    let image = Arc::new(fake::FakeImage::new());
    let token_requests = Arc::new(AtomicUsize::new(0));
    // Tokens are `tok-N`; bumping N expires every token given before.
    let generation = Arc::new(AtomicUsize::new(1));
    let port = Arc::new(std::sync::OnceLock::<u16>::new());
    let (served, counter, current, known_port) =
        (image.clone(), token_requests.clone(), generation.clone(), port.clone());
    let expected_basic = basic(TEST_USER, TEST_PASSWORD);
    let fake = fake::serve(move |request| {
        let path = request.uri().path().to_string();
        let query = request.uri().query().unwrap_or_default().to_string();
        let authorization = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let token = format!("tok-{}", current.load(Ordering::SeqCst));
        if path == "/token" {
            counter.fetch_add(1, Ordering::SeqCst);
            // Repositories under public/ get anonymous tokens (named
            // `token`), the others only with the credential (`access_token`).
            return if query.contains("scope=repository%3Apublic%2F") {
                fake::respond(StatusCode::OK, "application/json", format!(r#"{{"token":"{token}"}}"#).into_bytes())
            } else if authorization == Some(expected_basic.as_str()) {
                let body = format!(r#"{{"access_token":"{token}","expires_in":300}}"#);
                fake::respond(StatusCode::OK, "application/json", body.into_bytes())
            } else {
                fake::respond(StatusCode::UNAUTHORIZED, "application/json", b"{}".to_vec())
            };
        }
        if authorization == Some(format!("Bearer {token}").as_str()) {
            return served.answer(&path);
        }
        let repository = path.trim_start_matches("/v2/").split("/manifests/").next().unwrap_or_default();
        let repository = repository.split("/blobs/").next().unwrap_or_default();
        // The repository named "outside" names a token service on another
        // loopback address.
        let realm_host = if repository.starts_with("outside/") { "127.0.0.2" } else { "127.0.0.1" };
        let port = known_port.get().copied().unwrap_or_default();
        let challenge = format!(
            r#"Bearer realm="http://{realm_host}:{port}/token",service="fake",scope="repository:{repository}:pull""#
        );
        Response::builder()
            .status(StatusCode::UNAUTHORIZED)
            .header(header::WWW_AUTHENTICATE, challenge)
            .body(Body::from("{}"))
            .unwrap()
    })
    .await;
    port.set(fake.addr.port()).unwrap();
    let other = format!("127.0.0.2:{}", fake.addr.port());
    let config = config(&[&fake.host, &other]);
    let credential = credential(TEST_USER, TEST_PASSWORD, &["127.0.0.1"]);

    let outside = reference(&format!("{}/outside/app:1", fake.host), &config);
    let err = bounded("resolve", Client::new(&config).unwrap().resolve(&outside, Some(&credential))).await.unwrap_err();
    assert!(matches!(err, ImageError::Refused(_)) && err.to_string().contains("127.0.0.2"), "{err}");
    assert!(!err.to_string().contains(TEST_PASSWORD), "{err}");
    assert_eq!(token_requests.load(Ordering::SeqCst), 0, "the credential went nowhere");

    // Without a credential: an anonymous token where the service gives
    // one, an auth failure where it does not.
    let public = reference(&format!("{}/public/app:1", fake.host), &config);
    bounded("resolve", Client::new(&config).unwrap().resolve(&public, None)).await.unwrap();
    let inside = reference(&format!("{}/inside/app:1", fake.host), &config);
    let err = bounded("resolve", Client::new(&config).unwrap().resolve(&inside, None)).await.unwrap_err();
    assert!(matches!(err, ImageError::AuthFailed(_)), "{err}");

    // Within the hosts: a token, used for the manifest, config and blobs.
    let client = Client::new(&config).unwrap();
    let resolved = bounded("resolve", client.resolve(&inside, Some(&credential))).await.unwrap();
    assert_eq!(resolved.manifest_digest, image.manifest_digest);
    let before = token_requests.load(Ordering::SeqCst);
    download_all(&client, &resolved).await;
    assert_eq!(token_requests.load(Ordering::SeqCst), before, "the token is kept by the client");

    // An expired token is renewed once, with the credential given to resolve.
    generation.fetch_add(1, Ordering::SeqCst);
    download_all(&client, &resolved).await;
    assert_eq!(token_requests.load(Ordering::SeqCst), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_redirect_to_a_loopback_address_is_refused_unless_listed_and_carries_no_credential() {
    let image = Arc::new(fake::FakeImage::new());
    let (storage_requests, storage_authorized) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (layer, requests, authorized) = (image.layer.clone(), storage_requests.clone(), storage_authorized.clone());
    let storage = fake::serve(move |request| {
        requests.fetch_add(1, Ordering::SeqCst);
        if request.headers().contains_key(header::AUTHORIZATION) {
            authorized.fetch_add(1, Ordering::SeqCst);
        }
        fake::respond(StatusCode::OK, "application/octet-stream", layer.clone())
    })
    .await;
    let storage_port = storage.addr.port();
    let served = image.clone();
    let expected_basic = basic(TEST_USER, TEST_PASSWORD);
    let registry = fake::serve(move |request| {
        let path = request.uri().path().to_string();
        let authorization = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if authorization != Some(expected_basic.as_str()) {
            return Response::builder()
                .status(StatusCode::UNAUTHORIZED)
                .header(header::WWW_AUTHENTICATE, r#"Basic realm="fake""#)
                .body(Body::empty())
                .unwrap();
        }
        if !path.ends_with(&served.layer_digest) {
            return served.answer(&path);
        }
        // The repository says where its blobs are: a loopback address over
        // HTTPS, a name resolving to one, or a loopback address over HTTP.
        let repository = path.trim_start_matches("/v2/").split('/').next().unwrap_or_default();
        let origin = match repository {
            "named" => format!("https://localhost:{storage_port}"),
            "address" => format!("https://127.0.0.1:{storage_port}"),
            _ => format!("http://127.0.0.1:{storage_port}"),
        };
        let location = format!("{origin}/storage/{}", served.layer_digest);
        Response::builder()
            .status(StatusCode::TEMPORARY_REDIRECT)
            .header(header::LOCATION, location)
            .body(Body::empty())
            .unwrap()
    })
    .await;
    let credential = credential(TEST_USER, TEST_PASSWORD, &["127.0.0.1"]);
    let dir = ScratchDir::new("blobs");
    let dest = dir.join("blob");

    let only_registry = config(&[&registry.host]);
    for (repo, why) in [("address", "loopback"), ("named", "localhost resolves only to"), ("plain", "plain HTTP")] {
        let client = Client::new(&only_registry).unwrap();
        let target = reference(&format!("{}/{repo}/app:1", registry.host), &only_registry);
        let resolved = bounded("resolve", client.resolve(&target, Some(&credential))).await.unwrap();
        let err = bounded("a download", client.download_blob(&resolved, &resolved.layers[0], &dest, &mut |_| {}))
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::Refused(_)), "{repo}: {err}");
        assert!(err.to_string().contains(why), "{repo}: {err}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no file is left");
    }
    assert_eq!(storage_requests.load(Ordering::SeqCst), 0, "the storage host was never asked");

    let both = config(&[&registry.host, &storage.host]);
    let client = Client::new(&both).unwrap();
    let target = reference(&format!("{}/plain/app:1", registry.host), &both);
    let resolved = bounded("resolve", client.resolve(&target, Some(&credential))).await.unwrap();
    bounded("a download", client.download_blob(&resolved, &resolved.layers[0], &dest, &mut |_| {})).await.unwrap();
    assert_eq!(sha256_file(&dest), image.layer_digest);
    assert_eq!(storage_requests.load(Ordering::SeqCst), 1);
    assert_eq!(storage_authorized.load(Ordering::SeqCst), 0, "the credential stays with the registry's host");
}

fn basic(user: &str, password: &str) -> String {
    use base64::Engine;
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_is_tried_first_for_anonymous_pulls_of_the_default_registry_only() {
    let registry = Registry::start(None);
    let written = push(&registry, "team/app", "1.0", &[layered_image()], PushFormat::Oci, false);
    let asked = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let record = asked.clone();
    let empty_mirror = fake::serve(move |request| {
        let uri = request.uri().to_string();
        let authorized = request.headers().contains_key(header::AUTHORIZATION);
        record.lock().unwrap().push(format!("{uri} authorized={authorized}"));
        fake::not_found()
    })
    .await;
    let mirrored = |mirror: &str| RegistryConfig {
        mirror: Some(mirror.to_string()),
        default_registry: Some(registry.host.clone()),
        ..config(&[&registry.host, mirror])
    };
    let config = mirrored(&empty_mirror.host);
    let client = Client::new(&config).unwrap();
    let short = reference("team/app:1.0", &config);
    assert_eq!(short.registry, registry.host);
    let image = bounded("resolve", client.resolve(&short, None)).await.unwrap();
    assert_eq!(image.manifest_digest, written.images[0].manifest_digest, "the registry answered");
    let first = asked.lock().unwrap().first().cloned().unwrap_or_default();
    let ns = format!("ns={}", registry.host.replace(':', "%3A"));
    assert!(first.starts_with("/v2/team/app/manifests/1.0?") && first.contains(&ns), "{first}");
    download_all(&client, &image).await;

    // A pull with a credential, or from another registry, never asks it.
    asked.lock().unwrap().clear();
    let credential = credential(TEST_USER, TEST_PASSWORD, &["127.0.0.1"]);
    bounded("resolve", Client::new(&config).unwrap().resolve(&short, Some(&credential))).await.unwrap();
    let named = reference(&format!("{}/team/app:1.0", empty_mirror.host), &config);
    let _ = bounded("resolve", Client::new(&config).unwrap().resolve(&named, None)).await;
    let seen = asked.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "only the pull naming the mirror's host: {seen:?}");
    assert!(!seen[0].contains("ns="), "{seen:?}");

    // A mirror that has the image serves its manifest and blobs.
    let image = Arc::new(fake::FakeImage::new());
    let served = image.clone();
    let full_mirror = fake::serve(move |request| served.answer(request.uri().path())).await;
    let config = mirrored(&full_mirror.host);
    let client = Client::new(&config).unwrap();
    let resolved = bounded("resolve", client.resolve(&reference("team/app:1.0", &config), None)).await.unwrap();
    assert_eq!(resolved.manifest_digest, image.manifest_digest, "the mirror answered");
    download_all(&client, &resolved).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_come_over_https_from_a_host_whose_certificate_the_operator_trusts() {
    let image = Arc::new(fake::FakeImage::new());
    let dir = ScratchDir::new("ca");
    let ca = space_testkit::TestCa::new(&dir, "storage-ca");
    let layer = image.layer.clone();
    let storage = fake::serve_tls(ca.server(&["127.0.0.1".to_string()]), move |_| {
        fake::respond(StatusCode::OK, "application/octet-stream", layer.clone())
    })
    .await;
    let (served, storage_port) = (image.clone(), storage.addr.port());
    let registry = fake::serve(move |request| {
        let path = request.uri().path().to_string();
        if !path.ends_with(&served.layer_digest) {
            return served.answer(&path);
        }
        let location = format!("https://127.0.0.1:{storage_port}/storage/{}", served.layer_digest);
        Response::builder().status(StatusCode::FOUND).header(header::LOCATION, location).body(Body::empty()).unwrap()
    })
    .await;
    let dest = dir.join("blob");
    let target = format!("{}/app:1", registry.host);

    // Without the operator's CA the certificate is not trusted.
    let untrusting = config(&[&registry.host, &storage.host]);
    let client = Client::new(&untrusting).unwrap();
    let resolved = bounded("resolve", client.resolve(&reference(&target, &untrusting), None)).await.unwrap();
    let err = bounded("a download", client.download_blob(&resolved, &resolved.layers[0], &dest, &mut |_| {}))
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Network(_)), "{err}");
    assert!(!dest.exists());

    let trusting = RegistryConfig {
        extra_ca_pem: vec![std::fs::read(&ca.file).unwrap()],
        ..config(&[&registry.host, &storage.host])
    };
    let client = Client::new(&trusting).unwrap();
    let resolved = bounded("resolve", client.resolve(&reference(&target, &trusting), None)).await.unwrap();
    bounded("a download", client.download_blob(&resolved, &resolved.layers[0], &dest, &mut |_| {})).await.unwrap();
    assert_eq!(sha256_file(&dest), image.layer_digest);

    let bad_pem = RegistryConfig { extra_ca_pem: vec![b"not a certificate".to_vec()], ..config(&[]) };
    assert!(matches!(Client::new(&bad_pem), Err(ImageError::Config(_))));
}
