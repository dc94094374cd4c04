#!/usr/bin/env python3
"""Compares what PostgreSQL decoded for a witness slot with what the WAL relay
read (`make wal-witness`, scripts/wal-witness.sh).

The witness is a second logical slot on the same database, read with
PostgreSQL's own output plugin, test_decoding: `lsn|xid|data` lines of
`pg_logical_slot_peek_changes(slot, NULL, NULL, 'include-xids', '1')`. The
relay, run with `RUST_LOG=relay::wal=debug`, logs every transaction it read
from its own slot ("read a transaction xid=… end_lsn=… rows=… first_id=…
last_id=…": its orders.outbox inserts, and the ids of the first and last).

Every transaction the witness saw insert outbox rows must have been read by
the relay, with as many rows and the same first and last ids. A transaction
read twice (a stream restarted from its confirmed position) counts once.

    wal_witness.py WITNESS_FILE RELAY_LOG [--json OUT]   exit 0: none missed
"""

import argparse
import json
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
READ = re.compile(r"read a transaction xid=(\d+) end_lsn=(\S+) rows=(\d+)(?: first_id=(\d+) last_id=(\d+))?")
INSERT = re.compile(r"^table orders\.outbox: INSERT: id\[bigint\]:(\d+)")


def parse_witness(lines):
    """{xid: {"lsn": commit end, "rows": outbox inserts, "ids": [first, last]}}
    for every committed transaction with at least one outbox insert."""
    out, current = {}, None
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        lsn, xid, data = line.split("|", 2)
        if data.startswith("BEGIN"):
            current = {"rows": 0, "ids": []}
        elif data.startswith("COMMIT"):
            if current is not None and current["rows"] > 0:
                ids = current["ids"]
                out[int(xid)] = {"lsn": lsn, "rows": current["rows"], "ids": [min(ids), max(ids)]}
            current = None
        elif current is not None:
            m = INSERT.match(data)
            if m:
                current["rows"] += 1
                current["ids"].append(int(m.group(1)))
    return out


def parse_relay(lines):
    """{xid: {"lsn": end_lsn, "rows": outbox rows, "ids": [first, last] or
    None, "reads": times read}} of the relay's "read a transaction" debug
    lines."""
    out = {}
    for line in lines:
        m = READ.search(ANSI.sub("", line))
        if not m:
            continue
        xid, lsn, rows = int(m.group(1)), m.group(2), int(m.group(3))
        ids = [int(m.group(4)), int(m.group(5))] if m.group(4) and rows else None
        seen = out.setdefault(xid, {"lsn": lsn, "rows": rows, "ids": ids, "reads": 0})
        seen["reads"] += 1
        seen["rows"] = max(seen["rows"], rows)
    return out


def compare(witness, relay):
    """The witness's outbox transactions the relay never read, read with
    fewer rows, or read with other rows (first or last id not the
    witness's); and how many it read more than once."""
    missed, short, other = [], [], []
    for xid, w in sorted(witness.items(), key=lambda kv: kv[1]["ids"][0]):
        r = relay.get(xid)
        if r is None:
            missed.append({"xid": xid, **w})
        elif r["rows"] < w["rows"]:
            short.append({"xid": xid, **w, "relay_rows": r["rows"]})
        elif r["ids"] is not None and r["ids"] != w["ids"]:
            other.append({"xid": xid, **w, "relay_ids": r["ids"]})
    return {
        "witness_transactions": len(witness),
        "witness_rows": sum(w["rows"] for w in witness.values()),
        "relay_transactions": sum(1 for r in relay.values() if r["rows"] > 0),
        "relay_reread": sum(1 for r in relay.values() if r["reads"] > 1),
        "missed": missed,
        "short": short,
        "other": other,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("witness")
    ap.add_argument("relay_log")
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.witness, encoding="utf-8") as f:
        witness = parse_witness(f)
    with open(args.relay_log, encoding="utf-8", errors="replace") as f:
        relay = parse_relay(f)
    result = compare(witness, relay)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(
        f"witness: {result['witness_transactions']} transactions, {result['witness_rows']} outbox rows; "
        f"relay read {result['relay_transactions']} ({result['relay_reread']} of them more than once)"
    )
    for t in result["missed"]:
        print(f"MISSED xid {t['xid']} (commit ends {t['lsn']}): {t['rows']} rows, ids {t['ids'][0]}..{t['ids'][1]}")
    for t in result["short"]:
        print(f"SHORT xid {t['xid']} (commit ends {t['lsn']}): relay read {t['relay_rows']} of {t['rows']} rows")
    for t in result["other"]:
        print(
            f"OTHER xid {t['xid']} (commit ends {t['lsn']}): witness ids {t['ids'][0]}..{t['ids'][1]}, "
            f"relay read ids {t['relay_ids'][0]}..{t['relay_ids'][1]}"
        )
    return 1 if result["missed"] or result["short"] or result["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
