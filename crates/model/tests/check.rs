//! The model checked at the test bounds ([`Config::test`]): the correct
//! protocol breaks no property, and each broken variant's shortest
//! counter-example is found, with its length and its telling step pinned.

use model::{
    Bug, Config, PROPERTIES, Pipeline, check, check_acyclic, find, narrate_path, numbered,
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
    // shows here (update both).
    assert_eq!(outcome.unique, 98_342, "unique states at the test bounds");
    let acyclic = check_acyclic(config)
        .expect("a cycle: the terminal-state liveness check would not cover it");
    assert_eq!(acyclic, outcome.unique, "both searches see the same states");
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

#[test]
fn an_unfenced_lease_puts_a_stale_event_after_a_later_one_of_its_key() {
    let lines = counter_example(Bug::UnfencedLease);
    assert_eq!(lines.len(), 14, "{lines:#?}");
    assert!(has(&lines, "expires while it is paused"));
    assert!(has(&lines, "has expired: no fence"));
}
