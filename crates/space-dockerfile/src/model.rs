//! What planning produces: stages of steps, each step with the state it
//! runs in, and each stage's image config after its last instruction.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

/// The stages a build runs, in order, and which of them is the result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildPlan {
    /// Only the stages `target` needs; indices in `Base::Stage` and
    /// `CopyFrom::Stage` point into this list.
    pub stages: Vec<Stage>,
    pub target: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// `FROM … AS name`, lower-cased as Docker compares stage names.
    pub name: Option<String>,
    /// The line of its FROM.
    pub line: usize,
    pub base: Base,
    pub steps: Vec<Step>,
    pub config: ImageConfig,
}

/// What a stage starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Base {
    /// A registry image reference, after ARG expansion.
    Image(String),
    /// `FROM template:NAME`: a SPACE template of the tenant.
    Template(String),
    /// `FROM scratch`: an empty root.
    Scratch,
    /// An earlier stage of this plan.
    Stage(usize),
}

/// One instruction that changes the filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub line: usize,
    /// The instruction as written (continuation lines joined), for logs.
    pub text: String,
    pub kind: StepKind,
    /// ENV of the stage, then ARGs with a value that no ENV shadows.
    pub env: Vec<(String, String)>,
    pub user: Option<String>,
    pub workdir: String,
    pub shell: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepKind {
    /// The stage's SHELL followed by the text, or the exec form as written.
    Run {
        argv: Vec<String>,
    },
    Copy(CopyStep),
    /// Makes the directory (WORKDIR).
    Workdir {
        path: String,
    },
}

/// A COPY or ADD, with every word expanded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyStep {
    pub from: CopyFrom,
    /// As written after expansion; may hold globs. For the context they are
    /// relative to its root (a leading `/` does not leave it).
    pub sources: Vec<String>,
    /// Absolute, resolved against WORKDIR; a trailing `/` means "into this
    /// directory" and is kept.
    pub dest: String,
    /// `--chown` as written after expansion: `user[:group]`.
    pub chown: Option<String>,
    pub chmod: Option<u32>,
    /// ADD of a local tar archive (`.tar`, `.tar.gz`, `.tgz`, `.tar.zst`):
    /// such sources are unpacked into `dest`.
    pub unpack: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CopyFrom {
    /// The build context the request uploaded.
    Context,
    /// An earlier stage of this plan.
    Stage(usize),
    /// A registry image (`COPY --from=image:tag`).
    Image(String),
}

/// A stage's image defaults as its instructions leave them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    pub env: Vec<(String, String)>,
    pub workdir: String,
    pub user: Option<String>,
    pub shell: Vec<String>,
    pub cmd: Option<Vec<String>>,
    pub entrypoint: Option<Vec<String>>,
    pub labels: BTreeMap<String, String>,
    /// `80/tcp`, `53/udp`.
    pub exposed_ports: BTreeSet<String>,
}

impl Default for ImageConfig {
    fn default() -> Self {
        ImageConfig {
            env: Vec::new(),
            workdir: "/".into(),
            user: None,
            shell: default_shell(),
            cmd: None,
            entrypoint: None,
            labels: BTreeMap::new(),
            exposed_ports: BTreeSet::new(),
        }
    }
}

pub(crate) fn default_shell() -> Vec<String> {
    vec!["/bin/sh".into(), "-c".into()]
}

/// Why a Dockerfile cannot be planned: the API answers it as a 422.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub struct PlanError {
    /// The instruction's keyword (`HEALTHCHECK`), or "" when the text does
    /// not parse or the error is about the whole file.
    pub instruction: String,
    /// 1-based; 0 when the error has no line (an unknown `--target`).
    pub line: usize,
    pub message: String,
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}", self.message)
        } else {
            write!(f, "line {}: {}", self.line, self.message)
        }
    }
}
