//! The layer-cache key of a step: a sha256 over an unambiguous encoding of
//! everything the step's result depends on. Every field is length-prefixed,
//! so no two different inputs encode to the same bytes.

use sha2::{Digest, Sha256};

use crate::model::{CopyFrom, Step, StepKind};

/// Bumped when the encoding changes, so old keys stop matching.
const VERSION: &str = "space-dockerfile step key v1";

/// The cache key of `step` on top of the layer chain `parent`, for
/// `tenant` (steps are never shared across tenants: a RUN's result depends
/// on its network and its time). `inputs` is [`CopyStats::digest_of_inputs`]
/// for a COPY or ADD, so a changed context file changes the key.
///
/// The line and text of the step are not part of it: moving an instruction
/// or respelling a variable that expands the same does not rebuild.
///
/// [`CopyStats::digest_of_inputs`]: crate::CopyStats::digest_of_inputs
pub fn cache_key(tenant: &str, parent: &str, step: &Step, inputs: Option<&str>) -> String {
    let mut fields = Fields::default();
    fields.put(VERSION).put(tenant).put(parent);
    match &step.kind {
        StepKind::Run { argv } => {
            fields.put("run").list(argv);
        }
        StepKind::Workdir { path } => {
            fields.put("workdir").put(path);
        }
        StepKind::Copy(copy) => {
            fields.put("copy");
            match &copy.from {
                CopyFrom::Context => fields.put("context"),
                CopyFrom::Stage(index) => fields.put("stage").put(&index.to_string()),
                CopyFrom::Image(image) => fields.put("image").put(image),
            };
            fields.list(&copy.sources).put(&copy.dest);
            fields.option(copy.chown.as_deref()).option(copy.chmod.map(|m| format!("{m:o}")).as_deref());
            fields.put(if copy.unpack { "unpack" } else { "copy" });
        }
    }
    fields.put(&step.env.len().to_string());
    for (name, value) in &step.env {
        fields.put(name).put(value);
    }
    fields.option(step.user.as_deref()).put(&step.workdir).list(&step.shell).option(inputs);
    fields.finish()
}

/// Length-prefixed fields hashed with sha256.
#[derive(Default)]
pub(crate) struct Fields {
    hasher: Sha256,
}

impl Fields {
    pub(crate) fn put(&mut self, field: &str) -> &mut Self {
        self.bytes(field.as_bytes())
    }

    pub(crate) fn bytes(&mut self, field: &[u8]) -> &mut Self {
        self.hasher.update((field.len() as u64).to_be_bytes());
        self.hasher.update(field);
        self
    }

    pub(crate) fn number(&mut self, value: u64) -> &mut Self {
        self.bytes(&value.to_be_bytes())
    }

    fn list(&mut self, items: &[String]) -> &mut Self {
        self.number(items.len() as u64);
        for item in items {
            self.put(item);
        }
        self
    }

    fn option(&mut self, value: Option<&str>) -> &mut Self {
        match value {
            None => self.put("none"),
            Some(value) => self.put("some").put(value),
        }
    }

    pub(crate) fn finish(self) -> String {
        hex(&self.hasher.finalize())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::CopyStep;

    fn run_step() -> Step {
        Step {
            line: 3,
            text: "RUN make".into(),
            kind: StepKind::Run { argv: vec!["/bin/sh".into(), "-c".into(), "make".into()] },
            env: vec![("A".into(), "1".into())],
            user: None,
            workdir: "/".into(),
            shell: vec!["/bin/sh".into(), "-c".into()],
        }
    }

    fn copy_step() -> Step {
        Step {
            kind: StepKind::Copy(CopyStep {
                from: CopyFrom::Context,
                sources: vec!["a".into()],
                dest: "/app/".into(),
                chown: None,
                chmod: None,
                unpack: false,
            }),
            ..run_step()
        }
    }

    #[test]
    fn stable_for_the_same_inputs() {
        let key = cache_key("t1", "parent", &run_step(), None);
        assert_eq!(key.len(), 64);
        assert_eq!(key, cache_key("t1", "parent", &run_step(), None));
        // Where it was written does not matter.
        let moved = Step { line: 9, text: "RUN  make".into(), ..run_step() };
        assert_eq!(key, cache_key("t1", "parent", &moved, None));
    }

    #[test]
    fn every_input_changes_the_key() {
        let base = cache_key("t1", "parent", &copy_step(), Some("d1"));
        let with = |f: &dyn Fn(&mut Step)| {
            let mut step = copy_step();
            f(&mut step);
            cache_key("t1", "parent", &step, Some("d1"))
        };
        let copy = |f: &dyn Fn(&mut CopyStep)| {
            with(&|step: &mut Step| {
                if let StepKind::Copy(c) = &mut step.kind {
                    f(c)
                }
            })
        };
        let variants = [
            cache_key("t2", "parent", &copy_step(), Some("d1")),
            cache_key("t1", "other", &copy_step(), Some("d1")),
            cache_key("t1", "parent", &copy_step(), Some("d2")),
            cache_key("t1", "parent", &copy_step(), None),
            cache_key("t1", "parent", &run_step(), Some("d1")),
            with(&|s| s.env.push(("B".into(), "2".into()))),
            with(&|s| s.env[0].1 = "2".into()),
            with(&|s| s.user = Some("root".into())),
            with(&|s| s.workdir = "/srv".into()),
            with(&|s| s.shell = vec!["/bin/bash".into(), "-c".into()]),
            with(&|s| s.kind = StepKind::Workdir { path: "/app/".into() }),
            copy(&|c| c.from = CopyFrom::Stage(0)),
            copy(&|c| c.from = CopyFrom::Image("x".into())),
            copy(&|c| c.sources.push("b".into())),
            copy(&|c| c.dest = "/app".into()),
            copy(&|c| c.chown = Some("1:1".into())),
            copy(&|c| c.chmod = Some(0o644)),
            copy(&|c| c.unpack = true),
        ];
        for (index, variant) in variants.iter().enumerate() {
            assert_ne!(*variant, base, "variant {index} kept the key");
        }
        let mut unique: Vec<_> = variants.to_vec();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), variants.len(), "two different inputs gave one key");
    }

    #[test]
    fn fields_cannot_run_into_each_other() {
        let split = |a: &str, b: &str| {
            let mut step = run_step();
            step.kind = StepKind::Run { argv: vec![a.into(), b.into()] };
            cache_key("t", "p", &step, None)
        };
        assert_ne!(split("ab", "c"), split("a", "bc"));
        assert_ne!(cache_key("ab", "c", &run_step(), None), cache_key("a", "bc", &run_step(), None));
    }
}
