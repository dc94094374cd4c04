"""wal_witness.py: the witness's transactions against the relay's reads.

    python3 -m unittest discover -s scripts/lib
"""

import unittest

import wal_witness

WITNESS = """\
0/100|700|BEGIN 700
0/108|700|table orders.outbox: INSERT: id[bigint]:1 aggregate_id[uuid]:'a
0/110|700|table orders.outbox: INSERT: id[bigint]:2 aggregate_id[uuid]:'b
0/118|700|COMMIT 700
0/200|701|BEGIN 701
0/208|701|table public.other: INSERT: id[integer]:5
0/210|701|COMMIT 701
0/300|702|BEGIN 702
0/308|702|table orders.outbox: INSERT: id[bigint]:3 aggregate_id[uuid]:'c
0/310|702|COMMIT 702
0/400|703|BEGIN 703
0/408|703|table orders.outbox: INSERT: id[bigint]:4 aggregate_id[uuid]:'d
0/410|703|table orders.outbox: INSERT: id[bigint]:5 aggregate_id[uuid]:'e
0/418|703|COMMIT 703
""".splitlines()


def read(xid, lsn, rows, ids=None, colour=False):
    first, last = ids or (0, 0)
    if colour:  # as tracing wrote it to a file before it checked for a terminal
        return (
            f"\x1b[2m2026-11-24T00:00:00Z\x1b[0m \x1b[34mDEBUG\x1b[0m \x1b[2mrelay::wal\x1b[0m: read a transaction "
            f"\x1b[3mxid\x1b[0m\x1b[2m=\x1b[0m{xid} \x1b[3mend_lsn\x1b[0m\x1b[2m=\x1b[0m{lsn} "
            f"\x1b[3mrows\x1b[0m\x1b[2m=\x1b[0m{rows}"
        )
    return (
        f"2026-11-24T00:00:00Z DEBUG relay::wal: read a transaction xid={xid} end_lsn={lsn} rows={rows} "
        f"first_id={first} last_id={last}"
    )


class Witness(unittest.TestCase):
    def test_only_committed_transactions_with_outbox_inserts(self):
        w = wal_witness.parse_witness(WITNESS)
        self.assertEqual(sorted(w), [700, 702, 703])
        self.assertEqual(w[700], {"lsn": "0/118", "rows": 2, "ids": [1, 2]})
        self.assertEqual(w[703]["ids"], [4, 5])


class Compare(unittest.TestCase):
    def test_every_transaction_read_is_clean(self):
        relay = wal_witness.parse_relay(
            [
                read(700, "0/118", 2, (1, 2)),
                read(701, "0/210", 0),
                read(702, "0/310", 1, colour=True),
                read(703, "0/418", 2, (4, 5)),
            ]
        )
        result = wal_witness.compare(wal_witness.parse_witness(WITNESS), relay)
        self.assertEqual((result["missed"], result["short"], result["other"]), ([], [], []))
        self.assertEqual(result["witness_rows"], 5)
        self.assertEqual(result["relay_transactions"], 3)

    def test_a_transaction_never_read_is_missed_and_one_read_short_is_short(self):
        relay = wal_witness.parse_relay([read(700, "0/118", 2), read(703, "0/418", 1), "unrelated line"])
        result = wal_witness.compare(wal_witness.parse_witness(WITNESS), relay)
        self.assertEqual([t["xid"] for t in result["missed"]], [702])
        self.assertEqual(result["missed"][0]["ids"], [3, 3])
        self.assertEqual([(t["xid"], t["relay_rows"]) for t in result["short"]], [(703, 1)])

    def test_a_transaction_read_with_another_ones_rows_is_other(self):
        relay = wal_witness.parse_relay([read(700, "0/118", 2, (1, 2)), read(702, "0/310", 1, (1, 1))])
        result = wal_witness.compare(wal_witness.parse_witness(WITNESS), relay)
        self.assertEqual([(t["xid"], t["relay_ids"]) for t in result["other"]], [(702, [1, 1])])

    def test_a_transaction_read_again_after_a_restart_counts_once(self):
        relay = wal_witness.parse_relay([read(700, "0/118", 2), read(700, "0/118", 2)])
        self.assertEqual(relay[700]["reads"], 2)
        result = wal_witness.compare({700: {"lsn": "0/118", "rows": 2, "ids": [1, 2]}}, relay)
        self.assertEqual((result["missed"], result["relay_reread"]), ([], 1))


if __name__ == "__main__":
    unittest.main()
