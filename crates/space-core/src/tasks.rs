//! Background tasks owned and stoppable: a node's loops and actors, a
//! control plane's loops and what they start, each held in one set with
//! the token that tells them to stop, so that a shutdown ends them all and
//! knows they ended.
//!
//! Work that serves one request (a command's output, a stream, a build) is
//! not held here: it ends with its request or its connection.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::task::{AbortHandle, JoinSet};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

#[derive(Default)]
pub struct Tasks {
    stop: CancellationToken,
    set: Mutex<JoinSet<()>>,
}

impl Tasks {
    /// Runs `task` in the background until it ends by itself. One that
    /// would outlive a shutdown watches [`Tasks::stopping`] and ends soon
    /// after it fires, once what it holds is finished (a tick, a queue).
    /// After a shutdown began, `task` is dropped unstarted (`None`).
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> Option<AbortHandle> {
        let mut set = self.set.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock a shutdown takes the set with: a task is either in
        // the set it waits for, or never started.
        if self.stop.is_cancelled() {
            return None;
        }
        // Those that ended are let go (an aborted one is no news).
        while let Some(ended) = set.try_join_next() {
            if matches!(&ended, Err(err) if err.is_panic()) {
                tracing::error!("a background task panicked");
            }
        }
        Some(set.spawn(task))
    }

    /// [`Tasks::spawn`] for a task that may be stopped at any of its
    /// awaits: at a shutdown it is dropped there, as a killed process's
    /// would be (what it left half done — a node's operation, a control
    /// plane's claim in PostgreSQL — the next one takes up).
    pub fn spawn_cancellable(&self, task: impl Future<Output = ()> + Send + 'static) -> Option<AbortHandle> {
        let stop = self.stop.clone();
        self.spawn(async move {
            tokio::select! {
                biased;
                () = stop.cancelled() => {}
                () = task => {}
            }
        })
    }

    /// Fires when a shutdown begins.
    pub fn stopping(&self) -> WaitForCancellationFutureOwned {
        self.stop.clone().cancelled_owned()
    }

    /// Tasks started and not yet seen to end.
    pub fn running(&self) -> usize {
        let mut set = self.set.lock().unwrap_or_else(|e| e.into_inner());
        while set.try_join_next().is_some() {}
        set.len()
    }

    /// Tells every task to stop and waits (up to `patience`) until they
    /// did; those that did not by then are aborted.
    pub async fn stop(&self, patience: Duration) {
        self.stop.cancel();
        let mut set = std::mem::take(&mut *self.set.lock().unwrap_or_else(|e| e.into_inner()));
        let all_ended = async { while set.join_next().await.is_some() {} };
        if tokio::time::timeout(patience, all_ended).await.is_err() {
            tracing::warn!(tasks = set.len(), "background tasks still ran {patience:?} into the shutdown; aborted");
            set.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_shutdown_ends_every_task_and_starts_none_after() {
        let tasks = Tasks::default();
        let stopping = tasks.stopping();
        tasks.spawn(stopping);
        tasks.spawn_cancellable(std::future::pending());
        assert_eq!(tasks.running(), 2);
        // Far inside its patience: both end because they are told to, not
        // because they are aborted at its end.
        tokio::time::timeout(Duration::from_secs(10), tasks.stop(Duration::from_secs(600))).await.unwrap();
        assert_eq!(tasks.running(), 0);
        assert!(tasks.spawn(async {}).is_none(), "nothing starts after a shutdown");
    }

    #[tokio::test]
    async fn one_that_ignores_the_shutdown_is_aborted_after_the_patience() {
        let tasks = Tasks::default();
        tasks.spawn(std::future::pending());
        tokio::time::timeout(Duration::from_secs(10), tasks.stop(Duration::from_millis(50))).await.unwrap();
        assert_eq!(tasks.running(), 0);
    }
}
