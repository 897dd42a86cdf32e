//! Templates as the API sees them: built from Debian packages as an
//! operation (with progress and a log), listed, inspected and deleted.
//! Versions live on disk (`space-host`); builds in progress live here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use space_api::{CreateTemplateRequest, Operation, OperationKind, Template, TemplateDefaults, TemplateState};
use space_host::template::{valid_name, DebianBuild, TemplateInfo};

use crate::domain::{MAX_DISK_MIB, MAX_MEMORY_MIB, MAX_VCPUS, MIN_DISK_MIB, MIN_MEMORY_MIB};
use crate::error::ApiError;
use crate::platform::{new_operation, Platform};

/// Builds in progress: template name → (operation id, source).
#[derive(Default)]
pub(crate) struct Builds {
    in_progress: Mutex<HashMap<String, (String, serde_json::Value)>>,
}

fn valid_package(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && name.len() <= 128
        && bytes[0].is_ascii_alphanumeric()
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.:".contains(b))
}

fn api_template(info: &TemplateInfo, building: Option<String>) -> Template {
    let d = &info.meta.defaults;
    Template {
        name: info.meta.name.clone(),
        state: TemplateState::Ready,
        version: Some(info.meta.version),
        source: info.meta.source.clone(),
        defaults: Some(TemplateDefaults {
            vcpus: d.vcpus,
            memory_mib: d.memory_mib,
            disk_mib: d.disk_mib,
            env: d.env.clone(),
            workdir: d.workdir.clone(),
            user: d.user.clone(),
        }),
        created_at: Some(info.meta.created_at.clone()),
        building_operation: building,
    }
}

impl Platform {
    /// Accepts a Debian template build and runs it in the background.
    pub fn build_template(self: &Arc<Self>, request: CreateTemplateRequest) -> Result<(Template, Operation), ApiError> {
        let name = request.name.clone();
        if !valid_name(&name) {
            return Err(ApiError::bad_request(format!(
                "template names are 1-63 lowercase letters, digits, '-' or '_', got {name:?}"
            )));
        }
        let debian = &request.from.debian;
        if debian.packages.is_empty() || debian.packages.len() > 500 {
            return Err(ApiError::unprocessable("give between 1 and 500 packages"));
        }
        if let Some(bad) = debian.packages.iter().find(|p| !valid_package(p)) {
            return Err(ApiError::unprocessable(format!("not a Debian package name: {bad:?}")));
        }
        if debian.suite.is_empty() || !debian.suite.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(ApiError::unprocessable(format!("not a Debian suite: {:?}", debian.suite)));
        }
        let mut defaults = space_host::template::TemplateDefaults::default();
        let given = request.defaults;
        defaults.vcpus = given.vcpus.unwrap_or(defaults.vcpus);
        defaults.memory_mib = given.memory_mib.unwrap_or(defaults.memory_mib);
        defaults.disk_mib = given.disk_mib.unwrap_or(defaults.disk_mib);
        defaults.env = given.env;
        defaults.workdir = given.workdir.unwrap_or(defaults.workdir);
        defaults.user = given.user.unwrap_or(defaults.user);
        let in_range = |v: u32, min: u32, max: u32| (min..=max).contains(&v);
        if !in_range(defaults.vcpus, 1, MAX_VCPUS)
            || !in_range(defaults.memory_mib, MIN_MEMORY_MIB, MAX_MEMORY_MIB)
            || !in_range(defaults.disk_mib, MIN_DISK_MIB, MAX_DISK_MIB)
            || !defaults.workdir.starts_with('/')
        {
            return Err(ApiError::unprocessable(
                "defaults out of range (vcpus, memory_mib, disk_mib) or a relative workdir",
            ));
        }
        let source = serde_json::json!({"debian": {"suite": debian.suite, "packages": debian.packages}});

        let mut operation = new_operation(OperationKind::BuildTemplate, "", "queued", 4);
        operation.sandbox_id = None;
        operation.template = Some(name.clone());
        {
            let mut builds = self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner());
            if builds.contains_key(&name) {
                return Err(ApiError::new(
                    axum::http::StatusCode::CONFLICT,
                    "build_in_progress",
                    format!("template {name:?} is being built already"),
                ));
            }
            builds.insert(name.clone(), (operation.id.clone(), source.clone()));
        }
        self.store.put_operation(&operation, None)?;
        self.changed();

        let build = DebianBuild {
            name: name.clone(),
            suite: debian.suite.clone(),
            packages: debian.packages.clone(),
            defaults,
            log: self.data.log_path(&operation.id),
            apt_cache: Some(self.data.apt_cache_dir()),
        };
        let platform = self.clone();
        let operation_id = operation.id.clone();
        tokio::spawn(async move {
            let worker = platform.clone();
            let id = operation_id.clone();
            let built = tokio::task::spawn_blocking(move || {
                space_host::template::build_debian(&worker.data, &build, &worker.agent_bin, |p| {
                    worker.progress(&id, &p.step, p.done);
                })
            })
            .await;
            let error = match built {
                Ok(Ok(template)) => {
                    platform.refill_warm(template);
                    None
                }
                Ok(Err(err)) => {
                    tracing::warn!(template = %name, "build failed: {err}");
                    Some(ApiError::new(
                        axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                        "build_failed",
                        "the template build failed; see the operation's log",
                    ))
                }
                Err(err) => Some(ApiError::internal("building a template", err)),
            };
            platform.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
            platform.finish_operation(&operation_id, error);
        });
        let template = Template {
            name: request.name,
            state: TemplateState::Building,
            version: None,
            source,
            defaults: None,
            created_at: None,
            building_operation: Some(operation.id.clone()),
        };
        Ok((template, operation))
    }

    /// Every template: ready ones (newest version) and first builds.
    pub fn templates(&self) -> Vec<Template> {
        let building = self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut list: Vec<Template> = self
            .data
            .templates()
            .iter()
            .map(|info| api_template(info, building.get(&info.meta.name).map(|b| b.0.clone())))
            .collect();
        for (name, (operation, source)) in building {
            if !list.iter().any(|t| t.name == name) {
                list.push(Template {
                    name,
                    state: TemplateState::Building,
                    version: None,
                    source,
                    defaults: None,
                    created_at: None,
                    building_operation: Some(operation),
                });
            }
        }
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    pub fn template(&self, name: &str) -> Result<Template, ApiError> {
        self.templates().into_iter().find(|t| t.name == name).ok_or_else(|| {
            ApiError::new(axum::http::StatusCode::NOT_FOUND, "template_not_found", format!("no template {name:?}"))
        })
    }

    /// Removes template versions that are neither the newest nor used by a
    /// sandbox that still exists (rebuilds leave the old one behind until
    /// its last sandbox is gone), with their warm members.
    pub(crate) async fn reclaim_old_versions(&self) {
        let Ok(records) = self.store.sandboxes() else { return };
        let in_use: std::collections::HashSet<(String, u32)> = records
            .iter()
            .filter(|r| r.sandbox.state != space_api::SandboxState::Deleted)
            .map(|r| (r.sandbox.template.clone(), r.template_version))
            .collect();
        for template in self.data.templates() {
            let name = template.meta.name.clone();
            let newest = template.meta.version;
            let Ok(entries) = std::fs::read_dir(self.data.templates_dir().join(&name)) else { continue };
            for entry in entries.flatten() {
                let Some(version) = entry.file_name().to_str().and_then(|v| v.parse::<u32>().ok()) else { continue };
                if version >= newest || in_use.contains(&(name.clone(), version)) {
                    continue;
                }
                self.drain_warm_version(&name, version).await;
                let dir = entry.path();
                tracing::info!(template = %name, version, "reclaiming an unused old version");
                let removed = tokio::task::spawn_blocking(move || space_host::btrfs::remove_tree(&dir)).await;
                if let Ok(Err(err)) = removed {
                    tracing::warn!(template = %name, version, "reclaiming: {err}");
                }
            }
        }
    }

    /// Deletes every version of a template no sandbox uses.
    pub async fn delete_template(&self, name: &str) -> Result<(), ApiError> {
        self.template(name)?;
        if self.builds.in_progress.lock().unwrap_or_else(|e| e.into_inner()).contains_key(name) {
            return Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                "build_in_progress",
                format!("template {name:?} is being built"),
            ));
        }
        let users: Vec<String> = self
            .store
            .sandboxes()?
            .into_iter()
            .filter(|r| r.sandbox.template == name && r.sandbox.state != space_api::SandboxState::Deleted)
            .map(|r| r.sandbox.id)
            .collect();
        if !users.is_empty() {
            return Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                "template_in_use",
                format!("template {name:?} is used by {} sandbox(es); delete them first", users.len()),
            )
            .with_details(serde_json::json!({"sandboxes": users})));
        }
        self.drain_warm_template(name).await;
        let dir = self.data.templates_dir().join(name);
        tokio::task::spawn_blocking(move || space_host::btrfs::remove_tree(&dir))
            .await
            .map_err(|e| ApiError::internal("deleting a template", e))?
            .map_err(|e| ApiError::internal("deleting a template", e))
    }
}
