//! The control plane's background tasks — its loops (following the nodes'
//! feeds, spreading templates, watching the event head) and what they
//! start (a feed's follower, a node's sandboxes announced back) — held in
//! one set with the token that stops them, so that a shutdown ends them
//! all and knows they ended.
//!
//! Work that serves one request is not held here: it ends with its
//! request.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::task::{AbortHandle, JoinSet};
use tokio_util::sync::CancellationToken;

#[derive(Default)]
pub(crate) struct Tasks {
    stop: CancellationToken,
    set: Mutex<JoinSet<()>>,
}

impl Tasks {
    /// Runs `task` until it ends or a shutdown begins; then it is dropped
    /// at its next await, as a killed process would drop it (what it held
    /// in PostgreSQL — a feed's claim, a pull's — lapses and another
    /// replica takes it up). After a shutdown began, `task` is dropped
    /// unstarted (`None`).
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> Option<AbortHandle> {
        let stop = self.stop.clone();
        let mut set = self.set.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock a shutdown takes the set with: a task is either in
        // the set it waits for, or never started.
        if stop.is_cancelled() {
            return None;
        }
        // Those that ended are let go (an aborted follower is no news).
        while let Some(ended) = set.try_join_next() {
            if matches!(&ended, Err(err) if err.is_panic()) {
                tracing::error!("a control plane task panicked");
            }
        }
        Some(set.spawn(async move {
            tokio::select! {
                biased;
                () = stop.cancelled() => {}
                () = task => {}
            }
        }))
    }

    /// Tasks started and not yet seen to end.
    pub(crate) fn running(&self) -> usize {
        let mut set = self.set.lock().unwrap_or_else(|e| e.into_inner());
        while set.try_join_next().is_some() {}
        set.len()
    }

    /// Tells every task to stop and waits (up to `patience`) until they
    /// did; those that did not by then are aborted.
    pub(crate) async fn stop(&self, patience: Duration) {
        self.stop.cancel();
        let mut set = std::mem::take(&mut *self.set.lock().unwrap_or_else(|e| e.into_inner()));
        let all_ended = async { while set.join_next().await.is_some() {} };
        if tokio::time::timeout(patience, all_ended).await.is_err() {
            tracing::warn!(tasks = set.len(), "control plane tasks still ran {patience:?} into the shutdown; aborted");
            set.shutdown().await;
        }
    }
}
