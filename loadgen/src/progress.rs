//! Progress on stderr while the run goes: an `indicatif` bar on a terminal,
//! one plain line every 5 s otherwise (logs, CI). It only reads counters, a
//! few times a second, so it costs nothing measurable.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::ProgressMode;
use crate::shared::Shared;

/// The running display; [`Progress::finish`] stops it.
#[derive(Debug)]
pub(crate) struct Progress {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Progress {
    /// Starts the display for a run of `total` first attempts over `window`.
    pub(crate) fn start(
        shared: Arc<Shared>,
        mode: ProgressMode,
        total: u64,
        window: Duration,
    ) -> Self {
        let bar = match mode {
            ProgressMode::Off => {
                return Self {
                    stop: None,
                    task: None,
                };
            }
            ProgressMode::Bar => true,
            ProgressMode::Plain => false,
            ProgressMode::Auto => std::io::stderr().is_terminal(),
        };
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let bar = bar.then(|| make_bar(total));
            let every = if bar.is_some() {
                Duration::from_millis(500)
            } else {
                Duration::from_secs(5)
            };
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            let mut printed = 0;
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = &mut stopped => break,
                }
                let examples = new_examples(&shared, &mut printed);
                match &bar {
                    Some(bar) => {
                        bar.set_position(shared.first_handed_out.load(Ordering::Relaxed));
                        bar.set_message(short_status(&shared));
                        for e in examples {
                            bar.println(format!("loadgen: REPLAY MISMATCH {e}"));
                        }
                    }
                    None => {
                        eprintln!("loadgen: {}", status_line(&shared, window));
                        for e in examples {
                            eprintln!("loadgen: REPLAY MISMATCH {e}");
                        }
                    }
                }
            }
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
        });
        Self {
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops the display and waits for it to clear.
    pub(crate) async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

fn make_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(4));
    // The template is a constant; if indicatif ever refused it the bar would
    // just keep its default look.
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:20.cyan/blue}] {pos}/{len} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn status_line(shared: &Shared, window: Duration) -> String {
    let live = shared.lock().live();
    format!(
        "{:>4}s/{}s sent {} ok {} errors {} timeouts {} dropped {} in-flight {} mismatches {}",
        shared.start.elapsed().as_secs(),
        window.as_secs(),
        shared.sent.load(Ordering::Relaxed),
        live.ok,
        live.completed - live.ok,
        live.timeouts,
        shared.dropped.load(Ordering::Relaxed),
        shared.in_flight.load(Ordering::Relaxed),
        live.mismatches,
    )
}

/// The bar's message: short enough to fit an 80-column terminal next to the bar.
fn short_status(shared: &Shared) -> String {
    let live = shared.lock().live();
    format!(
        "ok {} err {} to {} drop {} fly {} mm {}",
        live.ok,
        live.completed - live.ok,
        live.timeouts,
        shared.dropped.load(Ordering::Relaxed),
        shared.in_flight.load(Ordering::Relaxed),
        live.mismatches,
    )
}

fn new_examples(shared: &Shared, printed: &mut usize) -> Vec<String> {
    let collector = shared.lock();
    let fresh = collector
        .replay
        .examples
        .get(*printed..)
        .unwrap_or_default()
        .to_vec();
    *printed += fresh.len();
    fresh
}
