//! Dockerfile → [`BuildPlan`]: parses with `parse-dockerfile`, refuses
//! what SPACE does not build (naming the instruction and its line),
//! expands ARG and ENV where Docker does, tracks each stage's running
//! state, and keeps only the stages the target needs.

use std::collections::{BTreeMap, BTreeSet};

use parse_dockerfile::{Command, Flag, FromInstruction, Instruction, Source};

use crate::expand::{self, ExpandError};
use crate::glob::clean;
use crate::model::{default_shell, Base, BuildPlan, CopyFrom, CopyStep, ImageConfig, PlanError, Stage, Step, StepKind};
use crate::words::{arg_names, join_continuations, name_values};

/// The only platform SPACE runs.
const PLATFORM: &str = "linux/amd64";

/// Suffixes of the local archives ADD unpacks.
const ARCHIVE_SUFFIXES: [&str; 4] = [".tar", ".tar.gz", ".tgz", ".tar.zst"];

/// Plans `dockerfile` with `build_args` (`--build-arg`) for `target` (a
/// stage name; the last stage when `None`). Image and template bases start
/// from an empty config: see [`plan_with_bases`].
pub fn plan(
    dockerfile: &str,
    build_args: &BTreeMap<String, String>,
    target: Option<&str>,
) -> Result<BuildPlan, PlanError> {
    plan_with_bases(dockerfile, build_args, target, &|_| None)
}

/// As [`plan`], with the config of each image or template base when the
/// caller has resolved it, so that `ENV PATH=/x:$PATH`, a relative WORKDIR
/// and the inherited USER, CMD and ENTRYPOINT see the base's values.
pub fn plan_with_bases(
    dockerfile: &str,
    build_args: &BTreeMap<String, String>,
    target: Option<&str>,
    base_config: &dyn Fn(&Base) -> Option<ImageConfig>,
) -> Result<BuildPlan, PlanError> {
    let parsed = parse_dockerfile::parse(dockerfile).map_err(|e| {
        let message = format!("{e:#}");
        let instruction = message
            .strip_prefix("unknown instruction '")
            .and_then(|rest| rest.strip_suffix('\''))
            .unwrap_or("")
            .to_string();
        PlanError { instruction, line: e.line(), message }
    })?;
    let lines = Lines::new(dockerfile, &parsed.instructions);
    if let Some(syntax) = &parsed.parser_directives.syntax {
        return Err(PlanError {
            instruction: "syntax".into(),
            line: lines.line(syntax.span().start),
            message: "the syntax parser directive is not supported".into(),
        });
    }
    let escape = parsed.parser_directives.escape.as_ref().map_or('\\', |d| d.value.value);

    // buildkit's platform ARGs are in the global scope undeclared.
    let mut globals: Vec<(String, Option<String>)> =
        AUTOMATIC_ARGS.iter().map(|name| (name.to_string(), automatic_arg(name).map(str::to_string))).collect();
    for arg in parsed.global_args() {
        let line = lines.line(arg.arg.span.start);
        for (name, default) in arg_names(&arg.arguments.value, escape) {
            let value = match (build_args.get(&name), default) {
                (Some(value), _) => Some(value.clone()),
                (None, Some(default)) => Some(expand_word(&default, escape, &[], &globals, "ARG", line)?),
                (None, None) => automatic_arg(&name).map(str::to_string),
            };
            globals.push((name, value));
        }
    }

    let all_names =
        parsed.stages().filter_map(|stage| stage.from.as_.as_ref().map(|(_, n)| n.value.to_lowercase())).collect();
    let mut planner = Planner {
        escape,
        build_args,
        globals,
        lines,
        base_config,
        names: BTreeMap::new(),
        all_names,
        stages: Vec::new(),
    };
    for (index, stage) in parsed.stages().enumerate() {
        let planned = planner.stage(index, stage.from, stage.instructions);
        if let Some((_, name)) = &stage.from.as_ {
            planner.names.insert(name.value.to_lowercase(), index);
        }
        planner.stages.push(planned);
    }
    planner.keep_for(target)
}

struct Planner<'a> {
    escape: char,
    build_args: &'a BTreeMap<String, String>,
    globals: Vec<(String, Option<String>)>,
    lines: Lines<'a>,
    base_config: &'a dyn Fn(&Base) -> Option<ImageConfig>,
    /// Names of the stages planned so far.
    names: BTreeMap<String, usize>,
    /// Names of all stages, to tell a later stage from an image.
    all_names: BTreeSet<String>,
    /// Every stage, planned or not: an error only matters if the target
    /// needs that stage.
    stages: Vec<Result<Stage, PlanError>>,
}

/// A stage's state between instructions.
struct State {
    config: ImageConfig,
    /// ARGs declared in this stage, in order (a later one wins).
    args: Vec<(String, Option<String>)>,
    cmd_set: bool,
}

impl Planner<'_> {
    fn stage(&self, index: usize, from: &FromInstruction, instructions: &[Instruction]) -> Result<Stage, PlanError> {
        let line = self.lines.line(from.from.span.start);
        let base = self.base(from, line)?;
        let config = match &base {
            Base::Stage(parent) => match &self.stages[*parent] {
                Ok(parent) => parent.config.clone(),
                Err(e) => return Err(e.clone()),
            },
            Base::Scratch => ImageConfig::default(),
            other => (self.base_config)(other).unwrap_or_default(),
        };
        let mut state = State { config, args: Vec::new(), cmd_set: false };
        let mut steps = Vec::new();
        for instruction in instructions {
            if let Some(step) = self.instruction(index, instruction, &mut state)? {
                steps.push(step);
            }
        }
        let name = from.as_.as_ref().map(|(_, name)| name.value.to_lowercase());
        Ok(Stage { name, line, base, steps, config: state.config })
    }

    fn base(&self, from: &FromInstruction, line: usize) -> Result<Base, PlanError> {
        for flag in &from.options {
            match flag.name.value.as_ref() {
                "platform" => {
                    let value = flag_value(flag, "FROM", line)?;
                    let platform = expand_word(value, self.escape, &[], &self.globals, "FROM", line)?;
                    if platform != PLATFORM {
                        return Err(error(
                            "FROM",
                            line,
                            format!("platform {platform:?} is not supported: builds run on {PLATFORM}"),
                        ));
                    }
                }
                other => return Err(error("FROM", line, format!("FROM --{other} is not supported"))),
            }
        }
        let image = expand_word(&from.image.value, self.escape, &[], &self.globals, "FROM", line)?;
        if image.is_empty() {
            return Err(error("FROM", line, "FROM needs an image: its reference expanded to nothing"));
        }
        if image.eq_ignore_ascii_case("scratch") {
            return Ok(Base::Scratch);
        }
        if let Some(name) = image.strip_prefix("template:") {
            if name.is_empty() {
                return Err(error("FROM", line, "FROM template: needs a template name"));
            }
            return Ok(Base::Template(name.to_string()));
        }
        Ok(match self.names.get(&image.to_lowercase()) {
            Some(&stage) => Base::Stage(stage),
            None => Base::Image(image),
        })
    }

    fn instruction(
        &self,
        stage: usize,
        instruction: &Instruction,
        state: &mut State,
    ) -> Result<Option<Step>, PlanError> {
        let (keyword, start) = keyword(instruction);
        let line = self.lines.line(start);
        let text = self.lines.text(start, self.escape);
        let escape = self.escape;
        let expand =
            |word: &str, state: &State| expand_word(word, escape, &state.config.env, &state.args, keyword, line);
        let kind = match instruction {
            Instruction::Run(run) => {
                for flag in &run.options {
                    match flag.name.value.as_ref() {
                        // The build request's network policy decides.
                        "network" => {}
                        other => return Err(error(keyword, line, format!("RUN --{other} is not supported"))),
                    }
                }
                if !run.here_docs.is_empty() {
                    return Err(error(keyword, line, "heredocs are not supported"));
                }
                StepKind::Run { argv: self.command(&run.arguments, &state.config.shell, keyword, line)? }
            }
            Instruction::Copy(copy) => {
                StepKind::Copy(self.copy(stage, keyword, line, &copy.options, &copy.src, &copy.dest.value, state)?)
            }
            Instruction::Add(add) => {
                StepKind::Copy(self.copy(stage, keyword, line, &add.options, &add.src, &add.dest.value, state)?)
            }
            Instruction::Workdir(workdir) => {
                let path = expand(&workdir.arguments.value, state)?;
                if path.is_empty() {
                    return Err(error(keyword, line, "WORKDIR needs a path"));
                }
                state.config.workdir = resolve(&state.config.workdir, &path);
                StepKind::Workdir { path: state.config.workdir.clone() }
            }
            Instruction::Env(env) => {
                let pairs = name_values(&env.arguments.value, escape)
                    .map_err(|why| error(keyword, line, format!("ENV {why}")))?;
                // Every pair sees the values from before this ENV, as in Docker.
                let mut expanded = Vec::new();
                for (name, value) in pairs {
                    let name = expand(&name, state)?;
                    if name.is_empty() {
                        return Err(error(keyword, line, "ENV names cannot be empty"));
                    }
                    expanded.push((name, expand(&value, state)?));
                }
                for (name, value) in expanded {
                    set(&mut state.config.env, name, value);
                }
                return Ok(None);
            }
            Instruction::Arg(arg) => {
                for (name, default) in arg_names(&arg.arguments.value, escape) {
                    let value = match (self.build_args.get(&name), default) {
                        (Some(value), _) => Some(value.clone()),
                        (None, Some(default)) => Some(expand(&default, state)?),
                        (None, None) => {
                            self.globals.iter().rev().find(|(n, _)| *n == name).and_then(|(_, v)| v.clone())
                        }
                    };
                    state.args.push((name, value));
                }
                return Ok(None);
            }
            Instruction::Label(label) => {
                let pairs = name_values(&label.arguments.value, escape)
                    .map_err(|why| error(keyword, line, format!("LABEL {why}")))?;
                for (name, value) in pairs {
                    let (name, value) = (expand(&name, state)?, expand(&value, state)?);
                    state.config.labels.insert(name, value);
                }
                return Ok(None);
            }
            Instruction::User(user) => {
                let user = expand(&user.arguments.value, state)?;
                if user.is_empty() {
                    return Err(error(keyword, line, "USER needs a user"));
                }
                state.config.user = Some(user);
                return Ok(None);
            }
            Instruction::Expose(expose) => {
                for word in &expose.arguments {
                    for port in expand(&word.value, state)?.split_whitespace() {
                        let port = exposed_port(port)
                            .ok_or_else(|| error(keyword, line, format!("EXPOSE {port:?} is not a port")))?;
                        state.config.exposed_ports.insert(port);
                    }
                }
                return Ok(None);
            }
            Instruction::Cmd(cmd) => {
                state.config.cmd = Some(self.command(&cmd.arguments, &state.config.shell, keyword, line)?);
                state.cmd_set = true;
                return Ok(None);
            }
            Instruction::Entrypoint(entrypoint) => {
                state.config.entrypoint =
                    Some(self.command(&entrypoint.arguments, &state.config.shell, keyword, line)?);
                // Docker drops a CMD the base image set once ENTRYPOINT changes.
                if !state.cmd_set {
                    state.config.cmd = None;
                }
                return Ok(None);
            }
            Instruction::Shell(shell) => {
                state.config.shell = shell.arguments.iter().map(|word| word.value.to_string()).collect();
                if state.config.shell.is_empty() {
                    state.config.shell = default_shell();
                }
                return Ok(None);
            }
            _ => return Err(error(keyword, line, format!("{keyword} is not supported"))),
        };
        Ok(Some(Step {
            line,
            text,
            kind,
            env: step_env(&state.config.env, &state.args),
            user: state.config.user.clone(),
            workdir: state.config.workdir.clone(),
            shell: state.config.shell.clone(),
        }))
    }

    fn command(
        &self,
        command: &Command,
        shell: &[String],
        keyword: &str,
        line: usize,
    ) -> Result<Vec<String>, PlanError> {
        Ok(match command {
            Command::Exec(exec) => exec.value.iter().map(|word| word.value.to_string()).collect(),
            Command::Shell(text) => {
                let mut argv = shell.to_vec();
                argv.push(join_continuations(text.value, self.escape));
                argv
            }
            _ => return Err(error(keyword, line, format!("this form of {keyword} is not supported"))),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        stage: usize,
        keyword: &str,
        line: usize,
        options: &[Flag],
        src: &[Source],
        dest: &str,
        state: &State,
    ) -> Result<CopyStep, PlanError> {
        let expand = |word: &str| expand_word(word, self.escape, &state.config.env, &state.args, keyword, line);
        let mut step = CopyStep {
            from: CopyFrom::Context,
            sources: Vec::new(),
            dest: String::new(),
            chown: None,
            chmod: None,
            unpack: false,
        };
        for flag in options {
            match flag.name.value.as_ref() {
                "from" => {
                    step.from = self.copy_from(stage, &expand(flag_value(flag, keyword, line)?)?, keyword, line)?
                }
                "chown" => step.chown = Some(expand(flag_value(flag, keyword, line)?)?).filter(|c| !c.is_empty()),
                "chmod" => {
                    let mode = expand(flag_value(flag, keyword, line)?)?;
                    let parsed = u32::from_str_radix(&mode, 8).ok().filter(|m| *m <= 0o7777);
                    step.chmod = Some(
                        parsed.ok_or_else(|| error(keyword, line, format!("--chmod={mode} is not an octal mode")))?,
                    );
                }
                // Layers are applied in order either way.
                "link" => {}
                other => return Err(error(keyword, line, format!("{keyword} --{other} is not supported"))),
            }
        }
        for source in src {
            let Source::Path(path) = source else {
                return Err(error(keyword, line, "heredocs are not supported"));
            };
            let path = expand(&path.value)?;
            let lower = path.to_ascii_lowercase();
            if lower.starts_with("git@")
                || lower.starts_with("git://")
                || (lower.contains("://") && (lower.ends_with(".git") || lower.contains(".git#")))
            {
                return Err(error(keyword, line, format!("{keyword} from a git repository is not supported")));
            }
            if lower.contains("://") {
                return Err(error(keyword, line, format!("{keyword} from a URL is not supported")));
            }
            if step.from == CopyFrom::Context && clean(path.trim_start_matches('/')).starts_with("..") {
                return Err(error(keyword, line, format!("{path:?} is outside the build context")));
            }
            step.sources.push(path);
        }
        let dest = expand(dest)?;
        if dest.is_empty() {
            return Err(error(keyword, line, format!("{keyword} needs a destination")));
        }
        step.dest = resolve_dest(&state.config.workdir, &dest);
        if step.sources.len() > 1 && !step.dest.ends_with('/') {
            return Err(error(
                keyword,
                line,
                format!("{keyword} with more than one source needs a destination directory ending in /"),
            ));
        }
        step.unpack = keyword == "ADD"
            && step.from == CopyFrom::Context
            && step
                .sources
                .iter()
                .any(|s| ARCHIVE_SUFFIXES.iter().any(|suffix| s.to_ascii_lowercase().ends_with(suffix)));
        Ok(step)
    }

    /// `--from`: an earlier stage by index or name, or an image.
    fn copy_from(&self, stage: usize, from: &str, keyword: &str, line: usize) -> Result<CopyFrom, PlanError> {
        if let Ok(index) = from.parse::<usize>() {
            if index >= stage {
                return Err(error(keyword, line, format!("--from={index}: only an earlier stage can be copied from")));
            }
            return Ok(CopyFrom::Stage(index));
        }
        if let Some(&index) = self.names.get(&from.to_lowercase()) {
            return Ok(CopyFrom::Stage(index));
        }
        if self.all_names.contains(&from.to_lowercase()) {
            return Err(error(keyword, line, format!("--from={from}: only an earlier stage can be copied from")));
        }
        if from.is_empty() {
            return Err(error(keyword, line, "--from needs a stage or an image"));
        }
        Ok(CopyFrom::Image(from.to_string()))
    }

    /// Keeps the stages `target` needs, renumbered in their order.
    fn keep_for(self, target: Option<&str>) -> Result<BuildPlan, PlanError> {
        let target = match target {
            None => self.stages.len() - 1,
            Some(name) => *self.names.get(&name.to_lowercase()).ok_or_else(|| PlanError {
                instruction: String::new(),
                line: 0,
                message: format!("target stage {name:?} is not defined"),
            })?,
        };
        let mut needed = BTreeSet::new();
        let mut pending = vec![target];
        while let Some(index) = pending.pop() {
            if !needed.insert(index) {
                continue;
            }
            let stage = self.stages[index].as_ref().map_err(Clone::clone)?;
            pending.extend(dependencies(stage));
        }
        let renumber: BTreeMap<usize, usize> = needed.iter().enumerate().map(|(new, &old)| (old, new)).collect();
        let mut stages = Vec::new();
        for (index, stage) in self.stages.into_iter().enumerate() {
            if !needed.contains(&index) {
                continue;
            }
            let mut stage = stage?;
            if let Base::Stage(parent) = &mut stage.base {
                *parent = renumber[parent];
            }
            for step in &mut stage.steps {
                if let StepKind::Copy(CopyStep { from: CopyFrom::Stage(from), .. }) = &mut step.kind {
                    *from = renumber[from];
                }
            }
            stages.push(stage);
        }
        Ok(BuildPlan { stages, target: renumber[&target] })
    }
}

fn dependencies(stage: &Stage) -> Vec<usize> {
    let base = match stage.base {
        Base::Stage(parent) => Some(parent),
        _ => None,
    };
    let copies = stage.steps.iter().filter_map(|step| match &step.kind {
        StepKind::Copy(CopyStep { from: CopyFrom::Stage(from), .. }) => Some(*from),
        _ => None,
    });
    base.into_iter().chain(copies).collect()
}

/// Line numbers and instruction text from byte offsets.
struct Lines<'a> {
    text: &'a str,
    /// Where each instruction's keyword starts, sorted.
    starts: Vec<usize>,
    /// Where each newline is: lines are found by binary search, so a long
    /// Dockerfile costs n log n, not n².
    newlines: Vec<usize>,
}

impl<'a> Lines<'a> {
    fn new(text: &'a str, instructions: &[Instruction]) -> Self {
        let mut starts: Vec<usize> = instructions.iter().map(|i| keyword(i).1).collect();
        starts.sort_unstable();
        let newlines = text.match_indices('\n').map(|(at, _)| at).collect();
        Lines { text, starts, newlines }
    }

    fn line(&self, offset: usize) -> usize {
        self.newlines.partition_point(|&at| at < offset) + 1
    }

    /// The instruction starting at `start` as written, continuations joined.
    fn text(&self, start: usize, escape: char) -> String {
        let next = self.starts.partition_point(|&s| s <= start);
        let end = self.starts.get(next).copied().unwrap_or(self.text.len());
        let joined = join_continuations(&self.text[start..end], escape);
        joined.lines().next().unwrap_or("").trim_end().to_string()
    }
}

fn keyword(instruction: &Instruction) -> (&'static str, usize) {
    match instruction {
        Instruction::Add(i) => ("ADD", i.add.span.start),
        Instruction::Arg(i) => ("ARG", i.arg.span.start),
        Instruction::Cmd(i) => ("CMD", i.cmd.span.start),
        Instruction::Copy(i) => ("COPY", i.copy.span.start),
        Instruction::Entrypoint(i) => ("ENTRYPOINT", i.entrypoint.span.start),
        Instruction::Env(i) => ("ENV", i.env.span.start),
        Instruction::Expose(i) => ("EXPOSE", i.expose.span.start),
        Instruction::From(i) => ("FROM", i.from.span.start),
        Instruction::Healthcheck(i) => ("HEALTHCHECK", i.healthcheck.span.start),
        Instruction::Label(i) => ("LABEL", i.label.span.start),
        Instruction::Maintainer(i) => ("MAINTAINER", i.maintainer.span.start),
        Instruction::Onbuild(i) => ("ONBUILD", i.onbuild.span.start),
        Instruction::Run(i) => ("RUN", i.run.span.start),
        Instruction::Shell(i) => ("SHELL", i.shell.span.start),
        Instruction::Stopsignal(i) => ("STOPSIGNAL", i.stopsignal.span.start),
        Instruction::User(i) => ("USER", i.user.span.start),
        Instruction::Volume(i) => ("VOLUME", i.volume.span.start),
        Instruction::Workdir(i) => ("WORKDIR", i.workdir.span.start),
        // A keyword a later parser knows and this planner does not.
        _ => ("instruction", 0),
    }
}

fn error(instruction: &str, line: usize, message: impl Into<String>) -> PlanError {
    PlanError { instruction: instruction.to_string(), line, message: message.into() }
}

fn flag_value<'f>(flag: &'f Flag, keyword: &str, line: usize) -> Result<&'f str, PlanError> {
    match &flag.value {
        Some(value) => Ok(value.value.as_ref()),
        None => Err(error(keyword, line, format!("{keyword} --{} needs a value", flag.name.value))),
    }
}

/// Expands `word` with ENV first, then ARGs (Docker: ENV shadows an ARG).
fn expand_word(
    word: &str,
    escape: char,
    env: &[(String, String)],
    args: &[(String, Option<String>)],
    keyword: &str,
    line: usize,
) -> Result<String, PlanError> {
    let lookup = |name: &str| -> Option<&str> {
        if let Some((_, value)) = env.iter().rev().find(|(n, _)| n == name) {
            return Some(value.as_str());
        }
        args.iter().rev().find(|(n, _)| n == name).and_then(|(_, value)| value.as_deref())
    };
    expand::expand(word, escape, &lookup).map_err(|e: ExpandError| error(keyword, line, e.to_string()))
}

const AUTOMATIC_ARGS: [&str; 8] = [
    "TARGETPLATFORM",
    "TARGETOS",
    "TARGETARCH",
    "TARGETVARIANT",
    "BUILDPLATFORM",
    "BUILDOS",
    "BUILDARCH",
    "BUILDVARIANT",
];

/// The platform ARGs buildkit defines for every build.
fn automatic_arg(name: &str) -> Option<&'static str> {
    Some(match name {
        "TARGETPLATFORM" | "BUILDPLATFORM" => PLATFORM,
        "TARGETOS" | "BUILDOS" => "linux",
        "TARGETARCH" | "BUILDARCH" => "amd64",
        "TARGETVARIANT" | "BUILDVARIANT" => "",
        _ => return None,
    })
}

fn set(env: &mut Vec<(String, String)>, name: String, value: String) {
    match env.iter_mut().find(|(n, _)| *n == name) {
        Some(entry) => entry.1 = value,
        None => env.push((name, value)),
    }
}

fn step_env(env: &[(String, String)], args: &[(String, Option<String>)]) -> Vec<(String, String)> {
    let mut out = env.to_vec();
    for (name, value) in args {
        let Some(value) = value else { continue };
        if env.iter().any(|(n, _)| n == name) {
            continue;
        }
        match out.iter_mut().find(|(n, _)| n == name) {
            Some(entry) => entry.1 = value.clone(),
            None => out.push((name.clone(), value.clone())),
        }
    }
    out
}

/// `path` against the working directory, cleaned, absolute.
fn resolve(workdir: &str, path: &str) -> String {
    if path.starts_with('/') {
        clean(path)
    } else {
        clean(&format!("{workdir}/{path}"))
    }
}

/// A COPY destination: absolute, and ending in `/` when it names a
/// directory to copy into (`dir/`, `.`, `..`).
fn resolve_dest(workdir: &str, dest: &str) -> String {
    let resolved = resolve(workdir, dest);
    let into = dest.ends_with('/') || dest == "." || dest == ".." || dest.ends_with("/.") || dest.ends_with("/..");
    if into && resolved != "/" {
        format!("{resolved}/")
    } else {
        resolved
    }
}

/// `80` → `80/tcp`; `53/UDP` → `53/udp`; ranges (`8000-8010`) are kept.
fn exposed_port(port: &str) -> Option<String> {
    let (number, protocol) = port.split_once('/').unwrap_or((port, "tcp"));
    let protocol = protocol.to_ascii_lowercase();
    let valid_number = |n: &str| n.parse::<u16>().is_ok();
    let numbers_ok = match number.split_once('-') {
        Some((low, high)) => valid_number(low) && valid_number(high),
        None => valid_number(number),
    };
    (numbers_ok && ["tcp", "udp", "sctp"].contains(&protocol.as_str())).then(|| format!("{number}/{protocol}"))
}
