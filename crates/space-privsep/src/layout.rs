//! Where the helper keeps what it makes: every path derived from the ids
//! of a request inside the one data dir the helper was started with, never
//! taken from the request.

use std::path::{Path, PathBuf};

use crate::proto::{
    BuildSource, ChainId, ImageRef, LayerKey, Request, SandboxId, SnapshotName, StartFrom, TemplateName, TemplateRef,
    VolumeId,
};

/// A Firecracker volume's ext4 image, in its `data` subvolume.
pub const VOLUME_IMAGE: &str = "disk.ext4";

/// Where the helper keeps what it makes, under the one data dir it was
/// started with. Every path is the data dir joined with fixed names and
/// validated ids, so none leaves it.
#[derive(Debug, Clone)]
pub struct Layout {
    data_dir: PathBuf,
}

impl Layout {
    /// `data_dir` comes from the helper's own configuration, never from a
    /// request.
    pub fn new(data_dir: impl Into<PathBuf>) -> Layout {
        Layout { data_dir: data_dir.into() }
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn sandbox_dir(&self, sandbox: &SandboxId) -> PathBuf {
        self.data_dir.join("sandboxes").join(sandbox.as_str())
    }

    pub fn sandbox_root(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("rootfs")
    }

    pub fn bundle_dir(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("bundle")
    }

    pub fn socket_dir(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("sock")
    }

    pub fn snapshot_dir(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("snapshot")
    }

    /// The layer chain a build sandbox started from (`StartFrom::Layer`),
    /// written by the helper beside the root, out of the sandbox's reach:
    /// `SaveLayer` keeps its root only as a layer on that chain.
    pub fn sandbox_chain(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("from-chain")
    }

    /// Where a start mounts the read-only views of the volumes the sandbox
    /// mounts read-only, while its engine sets up its mounts.
    /// A read-only Firecracker mount's own copy of the volume's image,
    /// taken at its start: the `index`th mount of the sandbox.
    pub fn volume_copy(&self, sandbox: &SandboxId, index: usize) -> PathBuf {
        self.sandbox_dir(sandbox).join(format!("volume-{index}.ext4"))
    }

    pub fn volume_views(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("volume-views")
    }

    /// A read-only bind mount of a volume's `data`, what a read-only mount
    /// of the sandbox binds (the host's kernel refuses its writes, not
    /// only the engine).
    pub fn volume_view(&self, sandbox: &SandboxId, volume: &VolumeId) -> PathBuf {
        self.volume_views(sandbox).join(volume.as_str())
    }

    /// The file runsc writes its output of the sandbox to.
    pub fn engine_log(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("runsc.log")
    }

    /// Where a saved image lives: under the sandbox that saved it, or a
    /// snapshot template's build dir (whichever sandbox saved it).
    pub fn image_dir(&self, sandbox: &SandboxId, image: &ImageRef) -> PathBuf {
        match image {
            ImageRef::Fork { operation } => self.sandbox_dir(sandbox).join("images").join(operation.as_str()),
            ImageRef::Checkpoint { name } => self.sandbox_dir(sandbox).join("checkpoints").join(name.as_str()),
            ImageRef::Template { template } => self.template_partial(template),
        }
    }

    /// Every version of a template, and its builds.
    pub fn template_name_dir(&self, name: &TemplateName) -> PathBuf {
        self.data_dir.join("templates").join(name.as_str())
    }

    pub fn template_dir(&self, template: &TemplateRef) -> PathBuf {
        self.template_name_dir(&template.name).join(template.version.get().to_string())
    }

    /// The read-only root a template's sandboxes are snapshots of.
    pub fn template_root(&self, template: &TemplateRef) -> PathBuf {
        self.template_dir(template).join("rootfs")
    }

    /// A build in progress, renamed to [`Layout::template_dir`] when published.
    pub fn template_partial(&self, template: &TemplateRef) -> PathBuf {
        self.template_name_dir(&template.name).join(format!(".{}.partial", template.version.get()))
    }

    /// Debian packages kept between template builds.
    pub fn apt_cache(&self) -> PathBuf {
        self.data_dir.join("cache").join("apt")
    }

    /// The layer chains image templates are made of (root's, like the
    /// apt cache).
    pub fn layer_cache(&self) -> PathBuf {
        self.data_dir.join("cache").join("layers")
    }

    /// A chain in the cache: `rootfs`, its read-only root.
    pub fn layer_dir(&self, chain: &ChainId) -> PathBuf {
        self.layer_cache().join(chain.as_str())
    }

    pub fn layer_root(&self, chain: &ChainId) -> PathBuf {
        self.layer_dir(chain).join("rootfs")
    }

    /// A chain being applied (`rootfs` and the importer's `work`), renamed
    /// to [`Layout::layer_dir`] when done.
    pub fn layer_partial(&self, chain: &ChainId) -> PathBuf {
        self.layer_cache().join(format!(".{}.partial", chain.as_str()))
    }

    /// Every volume (issue 37, decision 031), root's.
    pub fn volumes_dir(&self) -> PathBuf {
        self.data_dir.join("volumes")
    }

    /// A volume: its `data`, its `snapshots`, what a restore leaves.
    pub fn volume_dir(&self, volume: &VolumeId) -> PathBuf {
        self.volumes_dir().join(volume.as_str())
    }

    /// The volume's files: the subvolume a sandbox binds, under its limit.
    pub fn volume_data(&self, volume: &VolumeId) -> PathBuf {
        self.volume_dir(volume).join("data")
    }

    /// On a Firecracker node, the volume's ext4 image in its `data`: the
    /// drive a microVM mounts it from (decision 031).
    pub fn volume_image(&self, volume: &VolumeId) -> PathBuf {
        self.volume_data(volume).join(VOLUME_IMAGE)
    }

    /// A restore's new `data`, made beside it and renamed over it.
    pub fn volume_data_new(&self, volume: &VolumeId) -> PathBuf {
        self.volume_dir(volume).join("data.new")
    }

    /// The `data` a restore moved aside, removed once the new one is in.
    pub fn volume_data_old(&self, volume: &VolumeId) -> PathBuf {
        self.volume_dir(volume).join("data.old")
    }

    /// The volume's size limit in MiB, written when it is made (a restore
    /// puts its new `data` under the same one).
    pub fn volume_limit(&self, volume: &VolumeId) -> PathBuf {
        self.volume_dir(volume).join("limit-mib")
    }

    pub fn volume_snapshots(&self, volume: &VolumeId) -> PathBuf {
        self.volume_dir(volume).join("snapshots")
    }

    /// A read-only snapshot of the volume's `data`.
    pub fn volume_snapshot(&self, volume: &VolumeId, snapshot: &SnapshotName) -> PathBuf {
        self.volume_snapshots(volume).join(snapshot.as_str())
    }

    /// Every path of a volume a request can lead to.
    fn volume_paths(&self, volume: &VolumeId) -> [PathBuf; 6] {
        [
            self.volume_dir(volume),
            self.volume_data(volume),
            self.volume_data_new(volume),
            self.volume_data_old(volume),
            self.volume_limit(volume),
            self.volume_snapshots(volume),
        ]
    }

    /// `runsc --root`.
    pub fn runsc_state(&self) -> PathBuf {
        self.data_dir.join("run").join("runsc")
    }

    /// Every path a request can lead the helper to, for checks that none
    /// leaves the data dir.
    pub fn paths_of(&self, request: &Request) -> Vec<PathBuf> {
        let mut paths = Vec::new();
        let mut sandbox = |id: &SandboxId| {
            paths.extend([
                self.sandbox_dir(id),
                self.sandbox_root(id),
                self.bundle_dir(id),
                self.socket_dir(id),
                self.snapshot_dir(id),
                self.engine_log(id),
                self.sandbox_chain(id),
            ])
        };
        match request {
            Request::Hello { .. }
            | Request::List {}
            | Request::Availability {}
            | Request::ClearStaleQuotas {}
            | Request::VolumeStore {}
            | Request::ListLayers {} => {}
            Request::ListVolumes {} => paths.push(self.volumes_dir()),
            Request::States { sandboxes } | Request::SettleOrphans { sandboxes, .. } => {
                sandboxes.iter().for_each(&mut sandbox)
            }
            Request::Start { sandbox: id, from, mounts, .. } => {
                sandbox(id);
                paths.push(self.volume_views(id));
                for mount in mounts {
                    paths.extend(self.volume_paths(&mount.volume));
                    paths.push(self.volume_view(id, &mount.volume));
                }
                match from {
                    StartFrom::Template { template }
                    | StartFrom::TemplateImage { template }
                    | StartFrom::Clone { template } => {
                        paths.extend([self.template_dir(template), self.template_partial(template)])
                    }
                    StartFrom::Suspended {} => {}
                    StartFrom::Image { source, image } => paths.push(self.image_dir(source, image)),
                    StartFrom::Layer { chain } => paths.extend([self.layer_dir(chain), self.layer_root(chain)]),
                }
            }
            Request::SaveImage { sandbox: id, image } | Request::DropImage { sandbox: id, image } => {
                sandbox(id);
                paths.push(self.image_dir(id, image));
            }
            Request::Pause { sandbox: id }
            | Request::Resume { sandbox: id }
            | Request::Freeze { sandbox: id, .. }
            | Request::SetTimerSlack { sandbox: id, .. }
            | Request::Suspend { sandbox: id }
            | Request::Kill { sandbox: id, .. }
            | Request::Destroy { sandbox: id }
            | Request::State { sandbox: id }
            | Request::DropSnapshot { sandbox: id }
            | Request::Stop { sandbox: id }
            | Request::StopStrays { sandbox: id }
            | Request::EngineLog { sandbox: id }
            | Request::ListenAgent { sandbox: id }
            | Request::CloseAgent { sandbox: id }
            | Request::ConnectVmm { sandbox: id } => sandbox(id),
            Request::HasCloneBase { template, .. } => paths.push(self.template_dir(template)),
            Request::SaveCloneBase { sandbox: id, template } => {
                sandbox(id);
                paths.push(self.template_dir(template));
            }
            Request::BuildTemplate { template, source: BuildSource::Layers { top }, .. } => {
                paths.extend([self.template_dir(template), self.template_partial(template)]);
                paths.extend([self.layer_dir(top), self.layer_root(top)]);
            }
            Request::BuildTemplate { template, .. }
            | Request::ExportTemplate { template }
            | Request::BeginTemplate { template }
            | Request::PublishTemplate { template, .. } => {
                paths.extend([self.template_dir(template), self.template_partial(template)])
            }
            Request::CopyCheckpoint { template, sandbox: id, checkpoint } => {
                sandbox(id);
                paths.extend([
                    self.template_dir(template),
                    self.template_partial(template),
                    self.image_dir(id, &ImageRef::Checkpoint { name: checkpoint.clone() }),
                ]);
            }
            Request::HasLayer { chain } | Request::DeleteLayer { chain } => {
                paths.extend([self.layer_dir(chain), self.layer_root(chain), self.layer_partial(chain)])
            }
            Request::ApplyLayer { parent, layer, .. } => {
                let chain = ChainId::next(parent.as_ref(), layer);
                paths.extend([self.layer_dir(&chain), self.layer_root(&chain), self.layer_partial(&chain)]);
                if let Some(parent) = parent {
                    paths.extend([self.layer_dir(parent), self.layer_root(parent)]);
                }
            }
            Request::SaveLayer { sandbox: id, parent, key } => {
                sandbox(id);
                let chain = ChainId::next(Some(parent), &LayerKey::Step { key: key.clone() });
                paths.extend([self.layer_dir(&chain), self.layer_root(&chain), self.layer_partial(&chain)]);
                paths.extend([self.layer_dir(parent), self.layer_root(parent)]);
            }
            Request::CreateVolume { volume, from, .. } => {
                paths.extend(self.volume_paths(volume));
                if let Some((source, snapshot)) = from {
                    paths.push(self.volume_snapshot(source, snapshot));
                }
            }
            Request::DeleteVolume { volume }
            | Request::VolumeUsage { volume }
            | Request::VolumeFiles { volume, .. }
            | Request::AttachVolume { volume }
            | Request::DetachVolume { volume } => paths.extend(self.volume_paths(volume)),
            Request::SnapshotVolume { volume, snapshot }
            | Request::DeleteVolumeSnapshot { volume, snapshot }
            | Request::RestoreVolume { volume, snapshot } => {
                paths.extend(self.volume_paths(volume));
                paths.push(self.volume_snapshot(volume, snapshot));
            }
            Request::DeleteTemplate { name, version } => {
                paths.push(self.template_name_dir(name));
                if let Some(version) = version {
                    let template = TemplateRef { name: name.clone(), version: *version };
                    paths.extend([self.template_dir(&template), self.template_partial(&template)]);
                }
            }
        }
        paths
    }
}

#[cfg(test)]
mod tests {
    use std::path::Component;

    use super::*;
    use crate::proto::tests::every_request;

    #[test]
    fn every_path_a_request_leads_to_is_inside_the_data_dir() {
        let layout = Layout::new("/var/lib/space");
        for request in every_request() {
            for path in layout.paths_of(&request) {
                let rest = path.strip_prefix(layout.data_dir()).unwrap_or_else(|_| panic!("{path:?} left"));
                assert!(rest.components().all(|c| matches!(c, Component::Normal(_))), "{path:?}");
            }
        }
    }
}
