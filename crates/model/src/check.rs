// --- running a check ------------------------------------------------------------

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use stateright::{Checker, HasDiscoveries, Model, Path};

use crate::config::{Bug, Config, Fence};
#[cfg(doc)]
use crate::properties::{ENDS_WITH_ONE_EFFECT, NOT_CLAIMED};
use crate::properties::{PROPERTIES, REACHED};
use crate::state::{Action, State};
use crate::steps::Pipeline;

/// What a check found.
#[derive(Debug)]
pub struct Outcome {
    /// States generated (with repeats).
    pub states: usize,
    /// Distinct states.
    pub unique: usize,
    /// The longest path explored.
    pub max_depth: usize,
    /// Each property broken, with a counter-example, and each situation of
    /// [`REACHED`] reached, with an example.
    pub discoveries: Vec<(&'static str, Path<State, Action>)>,
    /// Wall time.
    pub elapsed: std::time::Duration,
}

/// Explores every state of `config` breadth first on one thread; stops early
/// once `stop_at` is broken, and at paths of `max_steps` actions.
///
/// `stateright` 0.31's BFS records a property's path again at every later
/// state that breaks it, so the path it returns is a counter-example but not
/// always a shortest one: [`find`] bounds the depth to get one.
pub fn check(config: Config, stop_at: Option<&'static str>, max_steps: Option<usize>) -> Outcome {
    let start = std::time::Instant::now();
    let mut builder = Pipeline(config).checker().threads(1);
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    if let Some(steps) = max_steps {
        // The depth counts states: a path of n actions has n + 1.
        builder = builder.target_max_depth(steps + 2);
    }
    let checker = builder.spawn_bfs().join();
    let mut discoveries: Vec<_> = checker.discoveries().into_iter().collect();
    discoveries.sort_by_key(|(name, _)| *name);
    Outcome {
        states: checker.state_count(),
        unique: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        discoveries,
        elapsed: start.elapsed(),
    }
}

/// Whether the state graph of `config` is acyclic (so every path ends in a
/// terminal state, and [`ENDS_WITH_ONE_EFFECT`] covers every run): a depth
/// first search over states by their hash. Returns the distinct states seen,
/// or `Err` with the depth at which a state reached itself.
pub fn check_acyclic(config: Config) -> Result<usize, usize> {
    fn fp(s: &State) -> u64 {
        let mut h = DefaultHasher::new();
        s.hash(&mut h);
        h.finish()
    }
    let model = Pipeline(config);
    // false: on the stack; true: done.
    let mut seen: HashMap<u64, bool> = HashMap::new();
    let mut stack: Vec<(State, Vec<State>)> = Vec::new();
    for init in model.init_states() {
        seen.insert(fp(&init), false);
        let next = model.next_states(&init);
        stack.push((init, next));
        while let Some((_, children)) = stack.last_mut() {
            match children.pop() {
                Some(child) => {
                    let f = fp(&child);
                    match seen.get(&f) {
                        Some(false) => return Err(stack.len()),
                        Some(true) => {}
                        None => {
                            seen.insert(f, false);
                            let next = model.next_states(&child);
                            stack.push((child, next));
                        }
                    }
                }
                None => {
                    if let Some((done, _)) = stack.pop() {
                        seen.insert(fp(&done), true);
                    }
                }
            }
        }
    }
    Ok(seen.len())
}

/// A shortest counter-example of `bug` at `base`'s bounds, with the first
/// search's counts and the time of all of them; `None` if there is none.
pub fn find(bug: Bug, base: &Config) -> (Option<Path<State, Action>>, Outcome) {
    find_broken(&bug.config(base), bug.breaks())
}

/// A shortest path of `config` that breaks `property`, with the first
/// search's counts and the time of all of them; `None` if there is none.
///
/// The first search stops at the first counter-example; each next one
/// looks only at paths shorter than the last found, until none is: the
/// last found is then a shortest one.
pub fn find_broken(
    config: &Config,
    property: &'static str,
) -> (Option<Path<State, Action>>, Outcome) {
    let start = std::time::Instant::now();
    let mut first: Option<Outcome> = None;
    let mut best: Option<Path<State, Action>> = None;
    let mut bound = None;
    loop {
        let mut outcome = check(config.clone(), Some(property), bound);
        let path = outcome
            .discoveries
            .iter()
            .position(|(n, _)| *n == property)
            .map(|i| outcome.discoveries.swap_remove(i).1);
        if first.is_none() {
            first = Some(outcome);
        }
        match path {
            Some(path) => {
                let steps = path.clone().into_actions().len();
                best = Some(path);
                if steps == 0 {
                    break;
                }
                bound = Some(steps - 1);
            }
            None => break,
        }
    }
    let mut outcome = first.unwrap_or(Outcome {
        states: 0,
        unique: 0,
        max_depth: 0,
        discoveries: Vec::new(),
        elapsed: std::time::Duration::ZERO,
    });
    outcome.elapsed = start.elapsed();
    (best, outcome)
}

impl Outcome {
    /// The properties of [`PROPERTIES`] broken (not the situations reached,
    /// nor those of [`NOT_CLAIMED`]).
    pub fn broken(&self) -> Vec<&'static str> {
        self.discoveries
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| PROPERTIES.contains(n))
            .collect()
    }

    /// Whether the check found `property` broken.
    pub fn breaks(&self, property: &str) -> bool {
        self.discoveries.iter().any(|(n, _)| *n == property)
    }

    /// The situations of [`REACHED`] that `config`'s faults allow and the
    /// check did not reach (a stale event after a later one of its key
    /// needs two relays, a lease expiry and a cancel, and is what
    /// [`Fence::Publish`] rules out).
    pub fn unreached(&self, config: &Config) -> Vec<&'static str> {
        let possible = [
            config.relay_crashes > 0 || config.lease_expiries > 0,
            config.lease_expiries > 0,
            config.payments_crashes > 0,
            config.expiry,
            config.expiry,
            config.cancel,
            config.cancel
                && config.relays >= 2
                && config.lease_expiries > 0
                && config.fence == Fence::Mark,
        ];
        REACHED
            .into_iter()
            .zip(possible)
            .filter(|&(r, p)| p && !self.discoveries.iter().any(|(n, _)| *n == r))
            .map(|(r, _)| r)
            .collect()
    }
}
