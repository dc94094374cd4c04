"""What a service's Prometheus histograms recorded between two scrapes.

    python3 scripts/lib/histo_delta.py A.txt B.txt NAME [NAME ...]

A and B are two scrapes of one /metrics (text format), B the later. Prints
one JSON object: per histogram NAME (summed over its label sets), the
observations between the scrapes (`count`) and their mean (`mean`), or
nulls when there were none. E.g. the relay's batches under a steady load:
relay_batch_size (rows per batch) and relay_publish_duration_seconds (a
batch's produce to its last ack).
"""

import json
import sys


def parse(path):
    """{metric name with its labels: value} of a text-format scrape."""
    values = {}
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            key, _, value = line.rstrip().rpartition(" ")
            try:
                values[key] = float(value)
            except ValueError:
                continue
    return values


def total(values, name):
    """The sum over label sets of `name` (a series named exactly, or with labels)."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def delta(a, b, name):
    count = total(b, name + "_count") - total(a, name + "_count")
    sum_ = total(b, name + "_sum") - total(a, name + "_sum")
    return {"count": int(count), "mean": round(sum_ / count, 6) if count > 0 else None}


def main(argv):
    if len(argv) < 4:
        sys.exit(__doc__)
    a, b = parse(argv[1]), parse(argv[2])
    print(json.dumps({name: delta(a, b, name) for name in argv[3:]}))


if __name__ == "__main__":
    main(sys.argv)
