//! The tenant's disk quota as a control plane tells it to a node, in the
//! `x-space-disk-quota` header of a request that may make the tenant hold
//! more disk: `MAX_MIB/ELSEWHERE_BYTES` (what it may hold in all, what it
//! holds on the other live nodes), or `none` (no quota).

use axum::http::HeaderMap;

use crate::error::ApiError;
use crate::platform::Platform;
use crate::tenants::Caller;

pub(crate) const DISK_QUOTA_HEADER: &str = "x-space-disk-quota";

/// On a node: the tenant's disk quota, when the control plane sends it
/// (only the control plane, with the node token, reaches this).
pub(crate) fn take_disk_quota(platform: &Platform, caller: &Caller, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(DISK_QUOTA_HEADER) else {
        return Ok(());
    };
    let told = match value.to_str().unwrap_or_default() {
        "none" => None,
        text => {
            let parsed =
                text.split_once('/').and_then(|(max, elsewhere)| Some((max.parse().ok()?, elsewhere.parse().ok()?)));
            let (max_mib, elsewhere_bytes) = parsed.ok_or_else(|| {
                ApiError::bad_request(format!("{DISK_QUOTA_HEADER} is MAX_MIB/ELSEWHERE_BYTES or `none`"))
            })?;
            Some(crate::disk::ToldQuota { max_mib, elsewhere_bytes })
        }
    };
    platform.told_disk_quotas.lock().unwrap_or_else(|e| e.into_inner()).insert(caller.tenant.clone(), told);
    Ok(())
}
