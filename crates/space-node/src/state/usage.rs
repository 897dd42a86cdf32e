//! Every running sandbox's recent resource samples.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Instant;

use space_api::UsagePoint;

/// The last sample's counters, to turn the next one's into a rate.
#[derive(Clone, Copy)]
pub(crate) struct Last {
    pub(crate) at: Instant,
    pub(crate) cpu_usec: u64,
}

#[derive(Default)]
pub(crate) struct Series {
    pub(crate) points: VecDeque<UsagePoint>,
    pub(crate) last: Option<Last>,
    pub(crate) cpu_usec: u64,
}

/// Every sandbox's recent samples.
#[derive(Default)]
pub struct UsageHistory {
    pub(crate) series: Mutex<HashMap<String, Series>>,
}
