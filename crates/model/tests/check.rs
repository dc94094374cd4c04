//! The model checked at the test bounds ([`Config::test`]): the correct
//! protocol (today's relay, which fences its mark and not its publish)
//! breaks no claimed property, with one relay or two; per-key order on the
//! log is found broken with two and kept by a fenced publish; each broken
//! variant's shortest counter-example is found, with its length and its
//! telling step pinned.

use model::{
    Bug, Config, Fence, LOG_IN_KEY_ORDER, PROPERTIES, Pipeline, REACHED, check, check_acyclic,
    find, find_broken, log_order_scope, narrate_path, numbered,
};

#[test]
fn the_correct_protocol_breaks_no_property_and_every_path_terminates() {
    let config = Config::test();
    let outcome = check(config.clone(), None, None);
    assert_eq!(
        outcome.broken(),
        Vec::<&str>::new(),
        "broken at the test bounds"
    );
    assert_eq!(PROPERTIES.len(), 6);
    // Every fault is exercised: a property does not hold for want of one.
    assert_eq!(
        outcome.unreached(&Config::test()),
        Vec::<&str>::new(),
        "not reached at the test bounds"
    );
    // The count FINDINGS §24 gives for these bounds: a change of the model
    // shows here (update both). (98,342 when the model fenced the publish:
    // `Fence::Publish` still has it.)
    assert_eq!(outcome.unique, 92_790, "unique states at the test bounds");
    let acyclic = check_acyclic(config)
        .expect("a cycle: the terminal-state liveness check would not cover it");
    assert_eq!(acyclic, outcome.unique, "both searches see the same states");
}

/// Two relays: a stale relay's publish lands after the next holder's
/// publish of its key's later event (the situation is reached), the log
/// loses its per-key order, and the effects keep theirs, as does the first
/// copy of each event on the log; nothing is lost or doubled.
#[test]
fn with_two_relays_the_log_loses_key_order_and_the_effects_keep_it() {
    let config = Config::test_two_relays();
    assert_eq!(config.fence, Fence::Mark, "today's relay");
    let outcome = check(config.clone(), None, None);
    assert_eq!(
        outcome.broken(),
        Vec::<&str>::new(),
        "a claimed property broken with two relays"
    );
    assert!(
        outcome.breaks(LOG_IN_KEY_ORDER),
        "the stale publish is no longer found: the model's relay fences its publish"
    );
    assert_eq!(
        outcome.unreached(&config),
        Vec::<&str>::new(),
        "not reached with two relays"
    );
    assert_eq!(outcome.unique, 59_047, "unique states with two relays");
    let acyclic = check_acyclic(config)
        .expect("a cycle: the terminal-state liveness check would not cover it");
    assert_eq!(acyclic, outcome.unique, "both searches see the same states");
}

/// The shortest path of today's relay that breaks per-key order on the log:
/// relay 1 paused after its claim, its lease gone, relay 0 publishing the
/// key's both events, then relay 1's produce landing after them.
#[test]
fn todays_relay_puts_a_stale_event_after_a_later_one_of_its_key_on_the_log() {
    let config = log_order_scope(&Config::test());
    let (path, _) = find_broken(&config, LOG_IN_KEY_ORDER);
    let path = path.expect("no counter-example: the model's relay fences its publish");
    let lines = narrate_path(&Pipeline(config), &path);
    println!(
        "today's relay breaks \"{LOG_IN_KEY_ORDER}\":\n{}",
        numbered(&lines)
    );
    assert_eq!(lines.len(), 14, "{lines:#?}");
    assert!(has(&lines, "expires while it is paused"));
    assert!(has(&lines, "relay 0 publishes row 2"));
    assert!(
        lines
            .last()
            .is_some_and(|l| l.contains("relay 1 publishes row 1")
                && l.contains("the publish is not fenced, only the mark")),
        "{lines:#?}"
    );
}

/// With the publish fenced by the lease's epoch (a transactional producer
/// per shard), the same two relays keep every copy on the log in key order.
#[test]
fn a_fenced_publish_keeps_every_copy_on_the_log_in_key_order() {
    let config = Config {
        fence: Fence::Publish,
        ..Config::test_two_relays()
    };
    let outcome = check(config.clone(), None, None);
    assert_eq!(outcome.broken(), Vec::<&str>::new());
    assert!(
        !outcome.breaks(LOG_IN_KEY_ORDER),
        "a stale publish got through"
    );
    assert!(
        !outcome.discoveries.iter().any(|(n, _)| *n == REACHED[6]),
        "a key's earlier event after its later one, with the publish fenced"
    );
    // The lease still moves under a claim: the fence has something to do.
    assert!(outcome.discoveries.iter().any(|(n, _)| *n == REACHED[1]));
}

/// The shortest counter-example of `bug`, printed, as its lines.
fn counter_example(bug: Bug) -> Vec<String> {
    let base = Config::test();
    let (path, _) = find(bug, &base);
    let path = path.unwrap_or_else(|| {
        panic!(
            "{}: the checker no longer finds a counter-example",
            bug.name()
        )
    });
    let lines = narrate_path(&Pipeline(bug.config(&base)), &path);
    println!(
        "{} breaks \"{}\":\n{}",
        bug.name(),
        bug.breaks(),
        numbered(&lines)
    );
    lines
}

fn has(lines: &[String], what: &str) -> bool {
    lines.iter().any(|l| l.contains(what))
}

#[test]
fn split_effect_first_doubles_an_effect_after_a_crash_at_split() {
    let lines = counter_example(Bug::SplitEffectFirst);
    assert_eq!(lines.len(), 8, "{lines:#?}");
    assert!(has(&lines, "kill -9 at 'split'"));
    assert!(has(&lines, "applies its effect (tx 1 of 2"));
}

#[test]
fn split_inbox_first_loses_an_effect_after_a_crash_at_split() {
    let lines = counter_example(Bug::SplitInboxFirst);
    assert_eq!(lines.len(), 15, "{lines:#?}");
    assert!(has(&lines, "kill -9 at 'split'"));
    assert!(has(&lines, "finds it in the inbox: a duplicate, skipped"));
}

#[test]
fn publish_before_commit_charges_an_order_that_never_commits() {
    let lines = counter_example(Bug::PublishBeforeCommit);
    assert_eq!(lines.len(), 4, "{lines:#?}");
    assert!(has(&lines, "before committing (dual write)"));
    assert!(has(&lines, "orders crashes (kill -9 after its publish"));
}

#[test]
fn save_then_publish_loses_the_event_of_a_committed_order() {
    let lines = counter_example(Bug::SaveThenPublish);
    assert_eq!(lines.len(), 5, "{lines:#?}");
    assert!(has(&lines, "no outbox row"));
    assert!(has(&lines, "orders crashes"));
}

#[test]
fn offsets_before_effect_loses_an_effect_after_a_crash() {
    let lines = counter_example(Bug::OffsetsBeforeEffect);
    assert_eq!(lines.len(), 12, "{lines:#?}");
    assert!(has(&lines, "commits the offset past it first"));
    assert!(has(
        &lines,
        "payments crashes (after the offset commit, before the transaction)"
    ));
}

#[test]
fn a_short_inbox_retention_applies_a_late_redelivery_twice() {
    let lines = counter_example(Bug::InboxRetentionShort);
    assert_eq!(lines.len(), 10, "{lines:#?}");
    assert!(has(&lines, "retention shorter than the horizon"));
    assert!(has(&lines, "delivered again"));
}
