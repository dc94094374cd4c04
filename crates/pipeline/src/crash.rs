//! Crash points: named places where a process SIGKILLs itself when a chaos
//! run asks it to, so the experiments can die at the worst possible moment
//! on purpose (the book, docs/book/src/faults.md). Off unless `--crash-point` names a point.

use std::sync::atomic::{AtomicU64, Ordering};

use clap::Args;

use crate::contract::CrashPoint;

/// Which crash point to arm, and how often it fires.
#[derive(Debug, Clone, Default, Args)]
pub struct CrashArgs {
    /// Arm these crash points (comma list, e.g. `publish` or `claim,effect`);
    /// the process SIGKILLs itself there. Chaos testing only.
    #[arg(long, env = crate::contract::env::CRASH_POINT, value_enum, value_delimiter = ',')]
    pub crash_point: Vec<CrashPoint>,

    /// Fire with this probability each time the armed point is passed.
    #[arg(long, env = crate::contract::env::CRASH_PROBABILITY, default_value_t = 0.0)]
    pub crash_probability: f64,

    /// Fire every Nth time an armed point is passed (counted per point and
    /// per process).
    #[arg(long, env = crate::contract::env::CRASH_EVERY)]
    pub crash_every: Option<u64>,

    /// Before firing, write the point's name to this file, so whoever
    /// supervises the process can tell which point killed it.
    #[arg(long, env = crate::contract::env::CRASH_MARKER_FILE)]
    pub crash_marker_file: Option<std::path::PathBuf>,

    /// What firing does: `kill` (SIGKILL, the default) or `stop` (SIGSTOP:
    /// the process hangs there, holding whatever it holds, until a SIGCONT;
    /// a hung process rather than a dead one).
    #[arg(long, env = crate::contract::env::CRASH_ACTION, value_enum, default_value_t = CrashAction::Kill)]
    pub crash_action: CrashAction,
}

/// What a crash point does when it fires.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CrashAction {
    /// SIGKILL: the process dies there.
    #[default]
    Kill,
    /// SIGSTOP: the process hangs there until SIGCONT, then goes on.
    Stop,
}

/// An armed (or unarmed) crash point checker; cheap to call on hot paths.
#[derive(Debug, Default)]
pub struct Crasher {
    args: CrashArgs,
    /// Passes so far of each armed point, in `args.crash_point` order.
    passes: Vec<AtomicU64>,
}

impl Crasher {
    /// A checker for `args`.
    pub fn new(args: CrashArgs) -> Self {
        let passes = args.crash_point.iter().map(|_| AtomicU64::new(0)).collect();
        Self { args, passes }
    }

    /// Passes `point`: SIGKILLs this process if `point` is armed and its
    /// schedule says so (never returning), or with `--crash-action stop`
    /// SIGSTOPs it (returning once it is continued).
    pub fn point(&self, point: CrashPoint) {
        let Some(armed) = self.args.crash_point.iter().position(|p| *p == point) else {
            return;
        };
        let Some(passes) = self.passes.get(armed) else {
            return;
        };
        let n = passes.fetch_add(1, Ordering::Relaxed) + 1;
        let every = self
            .args
            .crash_every
            .is_some_and(|e| e > 0 && n.is_multiple_of(e));
        let chance = self.args.crash_probability > 0.0
            && rand::random::<f64>() < self.args.crash_probability;
        if (every || chance)
            && let Some(marker) = &self.args.crash_marker_file
        {
            let _ = std::fs::write(marker, point.as_str());
        }
        if (every || chance) && self.args.crash_action == CrashAction::Stop {
            eprintln!("crash point {}: SIGSTOP (pass {n})", point.as_str());
            // Sent to this thread, not to the process: a stop signal stops
            // every thread either way, but one sent to the process is taken
            // by some other thread first, and this one ran on meanwhile (a
            // relay committed the batch it stopped in, 2 runs in 6 of
            // a_hung_relay_loses_its_shard_…). This thread stops before
            // pthread_kill returns to it.
            let _ = nix::sys::pthread::pthread_kill(
                nix::sys::pthread::pthread_self(),
                nix::sys::signal::Signal::SIGSTOP,
            );
            return; // resumed by SIGCONT
        }
        if every || chance {
            eprintln!("crash point {}: SIGKILL (pass {n})", point.as_str());
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
            // SIGKILL cannot be caught; should it somehow fail, die anyway.
            std::process::abort();
        }
    }
}
