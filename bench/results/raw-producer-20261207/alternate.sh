#!/bin/bash
# The raw producer of 2026-11-25's build (commit 189231b) against today's,
# alternated three times on today's cluster, 300,000 of the relay's messages
# each, on a fresh 6-partition topic as bench-pipeline made it then. Today's
# runs with linger.ms=5, the old build's setting, so the builds differ only
# in what else changed. Build the old one first:
#   git worktree add --detach /work/wt-old 189231b
#   (cd /work/wt-old && git apply "$PWD/bench/results/raw-producer-20261207/old-build.patch" &&
#    CARGO_TARGET_DIR=/work/old-target cargo build --release -p relay --example raw_producer)
# (the patch gives the old example today's TLS and SASL client settings, read
# from RAW_CLIENT_CONFIG, and rdkafka's "ssl" feature; nothing else), and
# today's with `cargo build --release -p relay --example raw_producer`.
# Run from the repository's root with the stack up: bash bench/results/raw-producer-20261207/alternate.sh
set -euo pipefail
OLD=${OLD:-/work/old-target/release/examples/raw_producer}
NEW=${NEW:-target/release/examples/raw_producer}
set -a; . .stack/env; set +a
for i in 1 2 3; do
  for which in old new; do
    topic=bench.raw.$which-$i-$(date +%H%M%S)
    target/release/kafka-tool create --topic "$topic" --partitions 6 \
      --config message.timestamp.type=CreateTime >/dev/null
    if [ "$which" = old ]; then
      out=$(env -u RAW_PAYLOAD -u RAW_HEADERS RUST_LOG=warn RAW_CLIENT_CONFIG="$KAFKA_CLIENT_CONFIG" \
        "$OLD" "$topic" 300000 281)
    else
      out=$(env -u RAW_PAYLOAD -u RAW_HEADERS RUST_LOG=warn RAW_SET=linger.ms=5 "$NEW" "$topic" 300000 281)
    fi
    echo "$which $i $out"
  done
done
