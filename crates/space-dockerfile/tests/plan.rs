//! Planning tables: every supported instruction, every refused one with its
//! line, stages, ARG scopes and expansion where Docker does it.

use std::collections::BTreeMap;

use space_dockerfile::{
    plan as plan_file, plan_with_bases, Base, BuildPlan, CopyFrom, CopyStep, ImageConfig, PlanError, Step, StepKind,
};

fn no_args() -> BTreeMap<String, String> {
    BTreeMap::new()
}

fn args(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn ok(dockerfile: &str) -> BuildPlan {
    plan_file(dockerfile, &no_args(), None).unwrap_or_else(|e| panic!("{dockerfile:?}: {e}"))
}

fn refused(dockerfile: &str) -> PlanError {
    match plan_file(dockerfile, &no_args(), None) {
        Ok(plan) => panic!("{dockerfile:?} was planned: {plan:?}"),
        Err(e) => e,
    }
}

/// The target stage's last step (WORKDIR makes steps too).
fn last_step(dockerfile: &str) -> Step {
    let plan = ok(dockerfile);
    plan.stages[plan.target].steps.last().unwrap_or_else(|| panic!("{dockerfile:?}: no steps")).clone()
}

fn copy_of(dockerfile: &str) -> CopyStep {
    match last_step(dockerfile).kind {
        StepKind::Copy(copy) => copy,
        other => panic!("{dockerfile:?}: not a copy: {other:?}"),
    }
}

fn argv_of(dockerfile: &str) -> Vec<String> {
    match last_step(dockerfile).kind {
        StepKind::Run { argv } => argv,
        other => panic!("{dockerfile:?}: not a run: {other:?}"),
    }
}

fn config_of(dockerfile: &str) -> ImageConfig {
    let plan = ok(dockerfile);
    plan.stages[plan.target].config.clone()
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn from_kinds() {
    let cases: &[(&str, Base)] = &[
        ("FROM debian:bookworm-slim", Base::Image("debian:bookworm-slim".into())),
        (
            "FROM --platform=linux/amd64 registry.example/team/app@sha256:abc",
            Base::Image("registry.example/team/app@sha256:abc".into()),
        ),
        ("FROM --platform=$BUILDPLATFORM debian", Base::Image("debian".into())),
        ("ARG BUILDPLATFORM\nFROM --platform=$BUILDPLATFORM debian", Base::Image("debian".into())),
        ("FROM scratch", Base::Scratch),
        ("FROM template:python-base", Base::Template("python-base".into())),
    ];
    for (dockerfile, want) in cases {
        assert_eq!(ok(dockerfile).stages[0].base, *want, "{dockerfile:?}");
    }
    let plan = ok("FROM debian AS Build\nRUN make\nFROM build\nRUN test\n");
    assert_eq!(plan.stages.len(), 2);
    assert_eq!(plan.stages[0].name.as_deref(), Some("build"));
    assert_eq!(plan.stages[1].base, Base::Stage(0));
    assert_eq!(plan.target, 1);
}

#[test]
fn refused_from_forms() {
    let e = refused("FROM --platform=linux/arm64 debian");
    assert_eq!((e.instruction.as_str(), e.line), ("FROM", 1));
    assert!(e.message.contains("linux/arm64"), "{e}");
    let e = refused("ARG IMG\nFROM $IMG\n");
    assert_eq!((e.instruction.as_str(), e.line), ("FROM", 2));
    let e = refused("FROM template:");
    assert_eq!(e.instruction, "FROM");
}

#[test]
fn global_args_in_from_and_build_arg_override() {
    let dockerfile = "ARG BASE=debian\nARG TAG=bookworm\nFROM ${BASE}:${TAG}-slim AS x\nARG TAG\nRUN echo $TAG\n";
    let plan = plan_file(dockerfile, &no_args(), None).unwrap();
    assert_eq!(plan.stages[0].base, Base::Image("debian:bookworm-slim".into()));
    // A global ARG is seen in a stage only once the stage declares it.
    assert_eq!(plan.stages[0].steps[0].env, env(&[("TAG", "bookworm")]));
    let plan = plan_file(dockerfile, &args(&[("TAG", "trixie"), ("UNUSED", "1")]), None).unwrap();
    assert_eq!(plan.stages[0].base, Base::Image("debian:trixie-slim".into()));
    assert_eq!(plan.stages[0].steps[0].env, env(&[("TAG", "trixie")]));
    let plan = ok("ARG TAG=1\nFROM debian\nRUN echo $TAG\n");
    assert!(plan.stages[0].steps[0].env.is_empty(), "undeclared in the stage: {:?}", plan.stages[0].steps[0].env);
}

#[test]
fn run_shell_and_exec_forms() {
    assert_eq!(argv_of("FROM debian\nRUN echo $HOME && ls"), ["/bin/sh", "-c", "echo $HOME && ls"]);
    assert_eq!(argv_of("FROM debian\nRUN [\"/bin/echo\", \"$HOME\"]"), ["/bin/echo", "$HOME"]);
    assert_eq!(
        argv_of("FROM debian\nRUN --network=none apt-get update \\\n  # why\n  && true"),
        ["/bin/sh", "-c", "apt-get update   && true"]
    );
    assert_eq!(
        argv_of("FROM debian\nSHELL [\"/bin/bash\", \"-o\", \"pipefail\", \"-c\"]\nRUN a | b"),
        ["/bin/bash", "-o", "pipefail", "-c", "a | b"]
    );
    assert_eq!(argv_of("# escape=`\nFROM debian\nRUN echo a `\n  b"), ["/bin/sh", "-c", "echo a   b"]);
    let step = last_step("FROM debian\nENV A=1\nARG B=2\nUSER app\nWORKDIR /srv\nRUN \\\n  true");
    assert_eq!(step.line, 6);
    assert_eq!(step.text, "RUN   true");
    assert_eq!(step.env, env(&[("A", "1"), ("B", "2")]));
    assert_eq!(step.user.as_deref(), Some("app"));
    assert_eq!(step.workdir, "/srv");
    assert_eq!(step.shell, ["/bin/sh", "-c"]);
}

#[test]
fn env_shadows_arg_and_sees_values_from_before() {
    let step = last_step("FROM debian\nARG V=arg\nENV V=env\nENV A=1\nENV A=2 B=$A\nRUN x");
    assert_eq!(step.env, env(&[("V", "env"), ("A", "2"), ("B", "1")]));
}

#[test]
fn env_forms() {
    let config = config_of(
        "FROM debian\nENV PATH=/opt/bin:$PATH GREETING=\"hello world\"\nENV OLDFORM a b  c\nENV Q='$PATH' E=x\\ y\n",
    );
    assert_eq!(
        config.env,
        env(&[("PATH", "/opt/bin:"), ("GREETING", "hello world"), ("OLDFORM", "a b  c"), ("Q", "$PATH"), ("E", "x y")])
    );
    let e = refused("FROM debian\nENV A=1 B\n");
    assert_eq!((e.instruction.as_str(), e.line), ("ENV", 2));
}

#[test]
fn base_config_is_seen_when_given() {
    let base_config = |base: &Base| match base {
        Base::Image(_) => Some(ImageConfig {
            env: env(&[("PATH", "/usr/bin")]),
            workdir: "/home/app".into(),
            user: Some("app".into()),
            cmd: Some(vec!["python".into()]),
            ..ImageConfig::default()
        }),
        _ => None,
    };
    let plan =
        plan_with_bases("FROM python\nENV PATH=/opt:$PATH\nWORKDIR src\nRUN x\n", &no_args(), None, &base_config)
            .unwrap();
    let stage = &plan.stages[0];
    assert_eq!(stage.steps[1].env, env(&[("PATH", "/opt:/usr/bin")]));
    assert_eq!(stage.steps[1].workdir, "/home/app/src");
    assert_eq!(stage.config.user.as_deref(), Some("app"));
    assert_eq!(stage.config.cmd, Some(vec!["python".to_string()]));
    // ENTRYPOINT drops a CMD inherited from the base, not one set here.
    let plan = plan_with_bases("FROM python\nENTRYPOINT [\"/e\"]\n", &no_args(), None, &base_config).unwrap();
    assert_eq!(plan.stages[0].config.cmd, None);
    let plan =
        plan_with_bases("FROM python\nCMD [\"c\"]\nENTRYPOINT [\"/e\"]\n", &no_args(), None, &base_config).unwrap();
    assert_eq!(plan.stages[0].config.cmd, Some(vec!["c".to_string()]));
}

#[test]
fn config_instructions() {
    let config = config_of(
        "FROM debian\nARG PORT=8080\nLABEL a=1 \"b c\"=\"d e\"\nLABEL old form value\nEXPOSE 80 $PORT 53/UDP 9000-9001/tcp\n\
         USER 1000:1000\nWORKDIR /app\nWORKDIR sub/../lib\nSHELL [\"/bin/bash\", \"-c\"]\nCMD python -m http.server\nENTRYPOINT [\"/tini\", \"--\"]\n",
    );
    assert_eq!(
        config.labels,
        [("a", "1"), ("b c", "d e"), ("old", "form value")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    );
    assert_eq!(
        config.exposed_ports.iter().map(String::as_str).collect::<Vec<_>>(),
        ["53/udp", "80/tcp", "8080/tcp", "9000-9001/tcp"]
    );
    assert_eq!(config.user.as_deref(), Some("1000:1000"));
    assert_eq!(config.workdir, "/app/lib");
    assert_eq!(config.shell, ["/bin/bash", "-c"]);
    assert_eq!(config.cmd, Some(vec!["/bin/bash".into(), "-c".into(), "python -m http.server".into()]));
    assert_eq!(config.entrypoint, Some(vec!["/tini".to_string(), "--".to_string()]));
    let e = refused("FROM debian\n\nEXPOSE http\n");
    assert_eq!((e.instruction.as_str(), e.line), ("EXPOSE", 3));
}

#[test]
fn workdir_is_a_step_relative_to_the_previous_one() {
    let plan = ok("FROM debian\nWORKDIR /a\nWORKDIR b\nENV D=c\nWORKDIR $D\n");
    let paths: Vec<_> = plan.stages[0]
        .steps
        .iter()
        .map(|s| match &s.kind {
            StepKind::Workdir { path } => path.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(paths, ["/a", "/a/b", "/a/b/c"]);
    assert_eq!(plan.stages[0].steps[2].workdir, "/a/b/c");
}

#[test]
fn copy_and_add_forms() {
    let copy = copy_of("FROM debian\nWORKDIR /app\nCOPY --chown=1000:1000 --chmod=640 --link src/*.py ./");
    assert_eq!(
        copy,
        CopyStep {
            from: CopyFrom::Context,
            sources: vec!["src/*.py".into()],
            dest: "/app/".into(),
            chown: Some("1000:1000".into()),
            chmod: Some(0o640),
            unpack: false,
        }
    );
    assert_eq!(copy_of("FROM debian\nWORKDIR /app\nCOPY a.txt b.txt").dest, "/app/b.txt");
    assert_eq!(copy_of("FROM debian\nWORKDIR /app\nCOPY a .").dest, "/app/");
    assert_eq!(copy_of("FROM debian\nCOPY a /").dest, "/");
    assert_eq!(copy_of("FROM debian\nCOPY [\"a b\", \"/c d/\"]").sources, ["a b"]);
    assert_eq!(copy_of("FROM debian\nARG F=x.txt\nENV D=/data\nCOPY $F ${D}/").sources, ["x.txt"]);
    assert_eq!(copy_of("FROM debian\nARG F=x.txt\nENV D=/data\nCOPY $F ${D}/").dest, "/data/");
    assert!(copy_of("FROM debian\nADD app.tar.gz /opt/").unpack);
    assert!(copy_of("FROM debian\nADD layer.TAR.ZST /opt/").unpack);
    assert!(!copy_of("FROM debian\nADD app.zip /opt/").unpack);
    assert!(!copy_of("FROM debian\nCOPY app.tar.gz /opt/").unpack);
    assert_eq!(copy_of("FROM debian\nCOPY /etc/app.conf /etc/").sources, ["/etc/app.conf"]);
}

#[test]
fn refused_copy_forms() {
    let cases: &[(&str, &str, &str)] = &[
        ("FROM debian\nADD https://files.example/x.tgz /x\n", "ADD", "URL"),
        ("FROM debian\nADD git@git.example:team/repo.git /src\n", "ADD", "git"),
        ("FROM debian\nADD https://git.example/team/repo.git#main /src\n", "ADD", "git"),
        ("FROM debian\nCOPY https://files.example/x /x\n", "COPY", "URL"),
        ("FROM debian\nCOPY ../secret /x\n", "COPY", "outside the build context"),
        ("FROM debian\nCOPY a/../../b /x\n", "COPY", "outside the build context"),
        ("FROM debian\nCOPY a b /dir\n", "COPY", "ending in /"),
        ("FROM debian\nCOPY --chmod=9 a /b\n", "COPY", "octal"),
        ("FROM debian\nCOPY --parents a /b/\n", "COPY", "--parents"),
        ("FROM debian\nADD --checksum=sha256:00 a /b\n", "ADD", "--checksum"),
        ("FROM debian\nCOPY <<EOF /x\nhello\nEOF\n", "COPY", "heredocs"),
        ("FROM debian\nCOPY --from=1 a /b\n", "COPY", "earlier stage"),
        ("FROM debian AS self\nCOPY --from=self a /b\n", "COPY", "earlier stage"),
    ];
    for (dockerfile, instruction, says) in cases {
        let e = refused(dockerfile);
        assert_eq!((e.instruction.as_str(), e.line), (*instruction, 2), "{dockerfile:?}: {e}");
        assert!(e.message.contains(says), "{dockerfile:?}: {e}");
    }
    let e = plan_file("FROM debian AS first\nCOPY --from=later a /b\nFROM x AS later\n", &no_args(), Some("first"))
        .unwrap_err();
    assert_eq!((e.instruction.as_str(), e.line), ("COPY", 2), "{e}");
    assert!(e.message.contains("earlier stage"), "{e}");
}

#[test]
fn unsupported_instructions_are_named_with_their_line() {
    let cases: &[(&str, &str, usize)] = &[
        ("FROM debian\nRUN true\n\n\n\n\nHEALTHCHECK CMD curl -f http://localhost/\n", "HEALTHCHECK", 7),
        ("FROM debian\nONBUILD RUN make\n", "ONBUILD", 2),
        ("FROM debian\n# a comment\nVOLUME /data\n", "VOLUME", 3),
        ("FROM debian\nSTOPSIGNAL SIGTERM\n", "STOPSIGNAL", 2),
        ("FROM debian\nMAINTAINER someone\n", "MAINTAINER", 2),
        ("FROM debian\nRUN --mount=type=cache,target=/root/.cache pip install x\n", "RUN", 2),
        ("FROM debian\nRUN --security=insecure true\n", "RUN", 2),
        ("FROM debian\nRUN <<EOF\necho hi\nEOF\n", "RUN", 2),
        ("# syntax=docker/dockerfile:1\nFROM debian\n", "syntax", 1),
    ];
    for (dockerfile, instruction, line) in cases {
        let e = refused(dockerfile);
        assert_eq!((e.instruction.as_str(), e.line), (*instruction, *line), "{dockerfile:?}: {e}");
    }
    let e = refused("FROM debian\nRUN true\n\n\n\n\nHEALTHCHECK CMD curl -f http://localhost/\n");
    assert_eq!(e.to_string(), "line 7: HEALTHCHECK is not supported");
    assert!(refused("FROM debian\nRUN --mount=type=cache,target=/c true\n").message.contains("--mount"));
    assert!(refused("FROM debian\nRUN --security=insecure true\n").message.contains("--security"));
}

#[test]
fn parse_errors_carry_their_line() {
    let e = refused("FROM debian\nRUN true\nFROBNICATE x\n");
    assert_eq!((e.instruction.as_str(), e.line), ("FROBNICATE", 3), "{e}");
    let e = refused("RUN true\n");
    assert_eq!(e.line, 1, "{e}");
    // Text that is not a JSON array is the shell form, as in Docker.
    assert_eq!(config_of("FROM debian\nCMD [\"a\"\n").cmd, Some(vec!["/bin/sh".into(), "-c".into(), "[\"a\"".into()]));
    let e = refused("FROM debian\nENV A=\"unclosed\n");
    assert_eq!((e.instruction.as_str(), e.line), ("ENV", 2), "{e}");
}

const MULTI: &str = "\
FROM golang AS build
RUN go build -o /out/app
FROM debian AS tools
RUN apt-get install -y curl
FROM alpine AS unused
RUN echo never
FROM scratch
COPY --from=build /out/app /app
COPY --from=1 /usr/bin/curl /usr/bin/
COPY --from=registry.example/base:1 /etc/ssl /etc/ssl
";

#[test]
fn multi_stage_copy_from_by_name_index_and_image() {
    let plan = ok(MULTI);
    let names: Vec<_> = plan.stages.iter().map(|s| s.name.clone()).collect();
    assert_eq!(names, [Some("build".to_string()), Some("tools".to_string()), None]);
    assert_eq!(plan.target, 2);
    let froms: Vec<_> = plan.stages[2]
        .steps
        .iter()
        .map(|s| match &s.kind {
            StepKind::Copy(copy) => copy.from.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(froms, [CopyFrom::Stage(0), CopyFrom::Stage(1), CopyFrom::Image("registry.example/base:1".into())]);
}

#[test]
fn target_selection_drops_unused_stages_and_renumbers() {
    let plan = plan_file(MULTI, &no_args(), Some("tools")).unwrap();
    assert_eq!(plan.stages.len(), 1);
    assert_eq!(plan.stages[0].name.as_deref(), Some("tools"));
    assert_eq!(plan.target, 0);
    let plan = plan_file(
        "FROM a AS one\nFROM b AS two\nFROM two AS three\nCOPY --from=one /x /y\nFROM c\n",
        &no_args(),
        Some("THREE"),
    )
    .unwrap();
    assert_eq!(plan.stages.len(), 3);
    assert_eq!(plan.stages[2].base, Base::Stage(1));
    let plan2 =
        plan_file("FROM a AS one\nFROM b AS two\nFROM one AS three\nFROM c\n", &no_args(), Some("three")).unwrap();
    assert_eq!(plan2.stages.len(), 2);
    assert_eq!(plan2.stages[1].base, Base::Stage(0));
    assert_eq!(plan2.target, 1);
    let e = plan_file(MULTI, &no_args(), Some("nope")).unwrap_err();
    assert_eq!(e.to_string(), "target stage \"nope\" is not defined");
    // An unsupported instruction in a stage the target does not need is
    // not the build's problem.
    let plan = plan_file("FROM a AS one\nHEALTHCHECK NONE\nFROM b\nRUN true\n", &no_args(), None).unwrap();
    assert_eq!(plan.stages.len(), 1);
    let e =
        plan_file("FROM a AS one\nHEALTHCHECK NONE\nFROM b\nCOPY --from=one /x /y\n", &no_args(), None).unwrap_err();
    assert_eq!((e.instruction.as_str(), e.line), ("HEALTHCHECK", 2));
}

#[test]
fn stage_inherits_config_from_its_base_stage_but_not_args() {
    let plan = ok("FROM debian AS base\nARG A=1\nENV E=2\nWORKDIR /w\nUSER u\nFROM base\nRUN x\n");
    let step = &plan.stages[1].steps[0];
    assert_eq!(step.env, env(&[("E", "2")]));
    assert_eq!(step.workdir, "/w");
    assert_eq!(step.user.as_deref(), Some("u"));
}

#[test]
fn arg_defaults_and_build_args() {
    let dockerfile = "FROM debian\nARG A=one B=$A C\nENV E=$B\nRUN x\n";
    let plan = plan_file(dockerfile, &no_args(), None).unwrap();
    assert_eq!(plan.stages[0].steps[0].env, env(&[("E", "one"), ("A", "one"), ("B", "one")]));
    let plan = plan_file(dockerfile, &args(&[("A", "two"), ("C", "three")]), None).unwrap();
    assert_eq!(plan.stages[0].steps[0].env, env(&[("E", "two"), ("A", "two"), ("B", "two"), ("C", "three")]));
    let plan = ok("FROM debian\nARG TARGETARCH\nRUN x\n");
    assert_eq!(plan.stages[0].steps[0].env, env(&[("TARGETARCH", "amd64")]));
}

#[test]
fn a_typical_two_stage_python_dockerfile() {
    let dockerfile = r#"# A comment before anything
ARG PYTHON=3.12
FROM python:${PYTHON}-slim AS deps
ENV PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/venv
ENV PATH="$VIRTUAL_ENV/bin:$PATH"
WORKDIR /src
COPY requirements.txt .
RUN python -m venv $VIRTUAL_ENV \
 && pip install -r requirements.txt

FROM python:${PYTHON}-slim
LABEL org.opencontainers.image.title="app"
COPY --from=deps /venv /venv
ENV PATH=/venv/bin:$PATH
WORKDIR /app
COPY --chown=1000:1000 . .
USER 1000
EXPOSE 8000
CMD ["python", "-m", "app"]
"#;
    let plan = plan_file(dockerfile, &args(&[("PYTHON", "3.13")]), None).unwrap();
    assert_eq!(plan.stages.len(), 2);
    let deps = &plan.stages[0];
    assert_eq!(deps.base, Base::Image("python:3.13-slim".into()));
    let kinds: Vec<_> = deps.steps.iter().map(|s| (s.line, s.text.split(' ').next().unwrap().to_string())).collect();
    assert_eq!(kinds, [(7, "WORKDIR".into()), (8, "COPY".into()), (9, "RUN".into())]);
    assert_eq!(
        deps.steps[1].kind,
        StepKind::Copy(CopyStep {
            from: CopyFrom::Context,
            sources: vec!["requirements.txt".into()],
            dest: "/src/".into(),
            chown: None,
            chmod: None,
            unpack: false,
        })
    );
    let run = &deps.steps[2];
    assert_eq!(run.env, env(&[("PIP_NO_CACHE_DIR", "1"), ("VIRTUAL_ENV", "/venv"), ("PATH", "/venv/bin:")]));
    assert_eq!(
        run.kind,
        StepKind::Run {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "python -m venv $VIRTUAL_ENV  && pip install -r requirements.txt".into()
            ]
        }
    );
    let app = &plan.stages[1];
    assert_eq!(plan.target, 1);
    assert!(matches!(&app.steps[0].kind, StepKind::Copy(c) if c.from == CopyFrom::Stage(0) && c.dest == "/venv"));
    assert!(
        matches!(&app.steps[2].kind, StepKind::Copy(c) if c.chown.as_deref() == Some("1000:1000") && c.dest == "/app/")
    );
    assert_eq!(app.config.user.as_deref(), Some("1000"));
    assert_eq!(app.config.cmd, Some(vec!["python".to_string(), "-m".into(), "app".into()]));
    assert_eq!(app.config.labels.get("org.opencontainers.image.title").map(String::as_str), Some("app"));
    assert_eq!(app.config.env, env(&[("PATH", "/venv/bin:")]));
}
