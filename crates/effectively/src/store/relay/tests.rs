//! The relay's unit tests: which groups of shards a `NOTIFY` wakes.

use super::*;

#[test]
fn a_notify_wakes_the_groups_of_the_shards_it_names_and_no_other() {
    assert!(group_woken(1 << 3, 3, 16));
    assert!(!group_woken(1 << 3, 5, 16));
    assert!(
        group_woken(1 << 15, 15, 16),
        "the last shard's bit is its own"
    );
    // Four groups: group 1 holds shards 1, 5, 9, 13.
    assert!(group_woken(1 << 13, 1, 4));
    assert!(!group_woken(1 << 13, 2, 4));
    assert!(group_woken(1 << 14, 2, 4));
    for g in 0..4 {
        assert!(group_woken(u16::MAX, g, 4), "every shard wakes every group");
        assert!(!group_woken(0, g, 4));
    }
    assert!(group_woken(1 << 7, 0, 1), "one group holds every shard");
}
