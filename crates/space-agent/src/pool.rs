//! A pool of reusable threads. Creating a thread inside gVisor costs about
//! 1.6 ms and every command needs three (two output pumps and a waiter), so
//! idle threads are kept and handed the next job instead.

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send>;

/// Idle threads retire after this long without work.
const IDLE_LIFETIME: Duration = Duration::from_secs(60);
/// At most this many idle threads are kept.
const MAX_IDLE: usize = 64;

static IDLE: Mutex<Vec<SyncSender<Job>>> = Mutex::new(Vec::new());

/// Runs `job` on an idle thread, or on a new one if none is idle.
pub fn run(job: impl FnOnce() + Send + 'static) {
    let mut job: Job = Box::new(job);
    loop {
        let idle = IDLE.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match idle {
            // A thread that retired in the meantime hands the job back.
            Some(worker) => match worker.send(job) {
                Ok(()) => return,
                Err(returned) => job = returned.0,
            },
            None => {
                if let Err(err) = thread::Builder::new().name("worker".into()).spawn(move || work(job)) {
                    eprintln!("space-agent: cannot start a thread: {err}");
                }
                return;
            }
        }
    }
}

fn work(first: Job) {
    first();
    loop {
        let (tx, rx) = sync_channel::<Job>(1);
        {
            let mut idle = IDLE.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() >= MAX_IDLE {
                return;
            }
            idle.push(tx);
        }
        match rx.recv_timeout(IDLE_LIFETIME) {
            Ok(job) => job(),
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn jobs_run_and_threads_are_reused() {
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..10 {
            let tx = tx.clone();
            super::run(move || tx.send((i, std::thread::current().id())).unwrap());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let results: Vec<_> = rx.iter().take(10).collect();
        let mut ids: Vec<_> = results.iter().map(|(_, id)| format!("{id:?}")).collect();
        ids.sort();
        ids.dedup();
        assert!(ids.len() < 10, "idle threads are reused: {} threads for 10 jobs", ids.len());
    }
}
