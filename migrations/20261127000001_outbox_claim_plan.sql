-- The relay's claim keeps one plan whatever the statistics say.
--
-- A queue table's statistics are often taken while it is empty: every row
-- published, then ANALYZE. The planner then believes every partial index
-- over pending rows holds about one row, so all of them look equally cheap.
-- When a burst fills the outbox before autovacuum analyzes again (it waits
-- for 10% of the table to change, and it naps for a minute), the claim's
-- "no earlier pending row of this aggregate" check scanned a whole partial
-- index for every row the claim returned, the aggregate a mere filter. A
-- 1,000-row claim took 11.7 s over a 30,000-row backlog and 210 s over
-- 300,000 (FINDINGS.md §20).
--
-- The claim now runs that check as a subquery per candidate
-- (crates/relay/src/outbox.rs), and the only partial index the check can
-- use is outbox_pending_by_aggregate, whose leading column is the
-- aggregate: one probe per candidate however wrong the estimates are.
-- * outbox_pending, on id alone, is dropped: the check could scan it for
--   id < the candidate's. Nothing else needs it: the backlog's count and
--   age read outbox_pending_by_aggregate, which covers the same rows.
-- * outbox_pending_by_shard, the claim's scan in id order, now leaves out
--   failed rows (as the claim does). Its predicate is no longer implied by
--   the check's (published_at IS NULL alone), so the check cannot scan it.
-- Keep it so: an index the check can use must lead with aggregate_id
-- (relay test a_claim_after_an_empty_outbox_was_analyzed_reads_each_row_once).
DROP INDEX orders.outbox_pending;
DROP INDEX orders.outbox_pending_by_shard;
CREATE INDEX outbox_pending_by_shard ON orders.outbox (shard, id)
    WHERE published_at IS NULL AND failed_at IS NULL;
