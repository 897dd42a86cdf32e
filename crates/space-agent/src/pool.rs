//! A pool of reusable threads. Creating a thread inside gVisor costs about
//! 1.6 ms and every command needs three (two output pumps and a waiter), so
//! idle threads are kept and handed the next job instead.
//!
//! Every job handed to the pool runs: an idle thread retires only while it
//! is still listed as idle, under the same lock that hands jobs out. (It
//! used to retire when its wait timed out, and a job handed to it between
//! the timeout and its exit was dropped unrun: a command's output pump,
//! so the command's exit came with no output. A frozen sandbox made that
//! likely: at the thaw every idle thread's wait times out at once, just as
//! the next request arrives.)

use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send>;

/// Idle threads retire after this long without work.
const IDLE_LIFETIME: Duration = Duration::from_secs(60);
/// At most this many idle threads are kept.
const MAX_IDLE: usize = 64;

/// An idle thread: where to hand it a job, and who it is.
struct Idle {
    worker: u64,
    jobs: SyncSender<Job>,
}

/// The threads waiting for work, the most recently idle last.
pub(crate) struct Pool {
    idle: Mutex<Vec<Idle>>,
    next_worker: std::sync::atomic::AtomicU64,
    lifetime: Duration,
}

static POOL: Pool = Pool::new(IDLE_LIFETIME);

/// Runs `job` on an idle thread, or on a new one if none is idle.
pub fn run(job: impl FnOnce() + Send + 'static) {
    POOL.run(Box::new(job));
}

impl Pool {
    pub(crate) const fn new(lifetime: Duration) -> Pool {
        Pool { idle: Mutex::new(Vec::new()), next_worker: std::sync::atomic::AtomicU64::new(0), lifetime }
    }

    pub(crate) fn run(&'static self, job: Job) {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match idle {
            // Taken off the list, the thread waits for this job until it
            // comes: the send cannot fail and the job is not lost.
            Some(idle) => {
                if let Err(returned) = idle.jobs.send(job) {
                    self.spawn(returned.0);
                }
            }
            None => self.spawn(job),
        }
    }

    fn spawn(&'static self, job: Job) {
        if let Err(err) = thread::Builder::new().name("worker".into()).spawn(move || self.work(job)) {
            eprintln!("space-agent: cannot start a thread: {err}");
        }
    }

    fn work(&self, first: Job) {
        first();
        loop {
            let (tx, rx) = sync_channel::<Job>(1);
            let worker = self.next_worker.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            {
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                if idle.len() >= MAX_IDLE {
                    return;
                }
                idle.push(Idle { worker, jobs: tx });
            }
            let job = match rx.recv_timeout(self.lifetime) {
                Ok(job) => job,
                Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {
                    let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(at) = idle.iter().position(|i| i.worker == worker) {
                        idle.remove(at);
                        return;
                    }
                    drop(idle);
                    // Someone took this thread off the list after the wait
                    // timed out: its job is on the way.
                    match rx.recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    }
                }
            };
            job();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::Pool;

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

    /// Jobs handed out just as idle threads retire all run: with a lifetime
    /// of a few microseconds, nearly every hand-out meets a thread whose
    /// wait is timing out.
    #[test]
    fn no_job_is_lost_to_a_retiring_thread() {
        static POOL: Pool = Pool::new(Duration::from_micros(20));
        static RAN: AtomicUsize = AtomicUsize::new(0);
        const JOBS: usize = 20_000;
        for i in 0..JOBS {
            POOL.run(Box::new(|| {
                RAN.fetch_add(1, Ordering::SeqCst);
            }));
            if i % 8 == 0 {
                // Lets some threads go idle and time out meanwhile.
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while RAN.load(Ordering::SeqCst) < JOBS && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(RAN.load(Ordering::SeqCst), JOBS, "every job handed to the pool ran");
    }
}
