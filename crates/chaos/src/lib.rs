//! Chaos: the pipeline under load, duplicate delivery and kill -9, then
//! recon's proof (the book, docs/book/src/chaos.md).
//!
//! Chaos runs orders, relay and payments as child processes (binaries never
//! depend on each other, so chaos talks to them only through processes,
//! environment, signals and `/metrics`), drives load with `loadgen`, and
//! injects three kinds of fault while the load runs:
//!
//! * crash points: the owning service is started with `CRASH_POINT=…` and
//!   SIGKILLs itself there (`publish`, `effect`, `claim`, `commit`, `split`);
//! * random kills: chaos SIGKILLs a named service at random moments;
//! * duplicate delivery: payments is started with `PAYMENTS_DUP_RATE`;
//! * infrastructure faults ([`faults`]): PostgreSQL crashed, a broker
//!   killed or paused, the relay hung, the group's offsets reset or scaled;
//!   the network's: a broker partitioned from the others, latency and loss
//!   to the brokers (through chaos's delay line, [`netlag`]), one relay cut
//!   off from the brokers or one payments instance from PostgreSQL (each
//!   instance in a [`cgroup`] of its own); with `--transport http` the
//!   webhook receiver down, answering 500, or slower than the sender's
//!   timeout (through chaos's webhook [`proxy`] between relay and payments)
//!   — after which the services must recover by themselves.
//!
//! Every death is followed by a restart. When the load ends, the faults stop
//! (later lives start unarmed, random kills end), recon waits for the
//! pipeline to drain and runs the diff. Chaos's exit status is recon's.
//!
//! Modules, each importing only those below it: [`run`] (the run loop) uses
//! [`spec`] (the children's environment and arguments), [`supervisor`] (one
//! per service), [`faults`] (which drives [`proxy`] and [`netlag`]),
//! [`cgroup`], [`scrape`] and
//! [`summary`] (the typed `chaos.json`); [`config`] is the flags.

pub mod cgroup;
pub mod config;
pub mod fault;
pub mod faults;
pub mod netlag;
pub mod proxy;
pub mod run;
pub mod scrape;
pub mod spec;
pub mod summary;
pub mod supervisor;

pub use crate::config::Config;
pub use crate::run::{EXIT_ERROR, run};
