//! `loadgen`: an open-model load generator for the Orders API that also
//! checks the service's idempotency (every replay must match the first
//! answer). See `loadgen --help`.

mod client;
mod config;
mod keys;
mod outcome;
mod progress;
mod report;
mod run;
mod schedule;
mod shared;
mod stats;
mod targets;
mod verify;

/// Types generated from `proto/orders.proto` (client side only).
#[allow(unreachable_pub, clippy::all, missing_docs)]
mod proto;

use std::process::ExitCode;

use clap::Parser;

use crate::config::Config;

/// mimalloc, not glibc's malloc, as in orders (FINDINGS §14): every request
/// allocates its body, headers and response; the load generator shares the
/// machine with what it measures, so its CPU is taken from the services'.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let settings = match Config::parse().resolve() {
        Ok(settings) => settings,
        Err(error) => {
            eprintln!("loadgen: {error:#}");
            return ExitCode::from(2);
        }
    };
    // One small runtime: the generator shares the machine with the service
    // and its database. With one thread, a current-thread runtime avoids any
    // cross-thread wake-ups.
    let runtime = if settings.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(settings.threads)
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("loadgen: cannot start the tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    // Spawned, so that with worker threads the main thread only waits and the
    // scheduler runs on a worker like everything else.
    let result = runtime.block_on(async { tokio::spawn(run::run(settings)).await });
    // Send tasks still blocked after the hard stop must not hold the exit up.
    runtime.shutdown_background();
    match result {
        Ok(Ok(code)) => ExitCode::from(code),
        Ok(Err(error)) => {
            eprintln!("loadgen: error: {error:#}");
            ExitCode::FAILURE
        }
        Err(join) => {
            eprintln!("loadgen: the run task failed: {join}");
            ExitCode::FAILURE
        }
    }
}
