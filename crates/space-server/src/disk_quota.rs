//! The tenant's disk quota as a control plane tells it to a node, in the
//! `x-space-disk-quota` header of a request that may make the tenant hold
//! more disk (`space_api::cluster::DiskAllowance`).

use axum::http::HeaderMap;
use space_api::cluster::{DiskAllowance, DISK_QUOTA_HEADER};

use crate::error::ApiError;
use crate::platform::Platform;
use crate::tenants::Caller;

/// On a node: the tenant's disk quota, when the control plane sends it
/// (only the control plane, with the node token, reaches this).
pub(crate) fn take_disk_quota(platform: &Platform, caller: &Caller, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(DISK_QUOTA_HEADER) else {
        return Ok(());
    };
    let told = match DiskAllowance::from_header(value.to_str().unwrap_or_default()).map_err(ApiError::bad_request)? {
        DiskAllowance::Unlimited => None,
        DiskAllowance::Quota { max_mib, elsewhere_bytes } => Some(crate::disk::ToldQuota { max_mib, elsewhere_bytes }),
    };
    platform.told_disk_quota(&caller.tenant, told);
    Ok(())
}
