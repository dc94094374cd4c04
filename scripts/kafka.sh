#!/usr/bin/env bash
# Apache Kafka's own command-line tools against the embedded stack, from the
# jars `make up` resolved (scripts/kafka/pom.xml), with --bootstrap-server
# set to the stack's brokers unless you give one:
#
#   scripts/kafka.sh topics --describe --topic order.events
#   scripts/kafka.sh consumer-groups --describe --group payments
#   scripts/kafka.sh console-consumer --topic order.events --from-beginning --max-messages 5
#   scripts/kafka.sh metadata-quorum describe --status
#
# (`make kafka ARGS="topics --list"` runs the same.) The tools are the ones
# the Kafka distribution's bin/kafka-*.sh scripts start; kafka-tool
# (`cargo run -p pipeline --features kafka --bin kafka-tool -- --help`)
# adds what they lack.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS_CACHE=${TOOLS_CACHE:-$HOME/.cache/effectively}
POM=$ROOT/scripts/kafka/pom.xml
VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM")
LIBS=$TOOLS_CACHE/kafka-$VERSION-$(sha256sum "$POM" | cut -c1-12)/libs

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  echo "tools: topics consumer-groups console-consumer console-producer metadata-quorum get-offsets configs"
}

[ $# -gt 0 ] || { usage >&2; exit 2; }
config_flag=--command-config
case $1 in
  -h|--help|help) usage; exit 0 ;;
  topics) main=org.apache.kafka.tools.TopicCommand ;;
  consumer-groups) main=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ;;
  console-consumer) main=org.apache.kafka.tools.consumer.ConsoleConsumer config_flag=--consumer.config ;;
  console-producer) main=org.apache.kafka.tools.ConsoleProducer config_flag=--producer.config ;;
  metadata-quorum) main=org.apache.kafka.tools.MetadataQuorumCommand ;;
  get-offsets) main=org.apache.kafka.tools.GetOffsetShell ;;
  configs) main=kafka.admin.ConfigCommand ;;
  *) echo "kafka.sh: unknown tool '$1'" >&2; usage >&2; exit 2 ;;
esac
shift
[ -d "$LIBS" ] || { echo "kafka.sh: Kafka $VERSION is not resolved yet; run make up" >&2; exit 1; }

if { [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ] || [ -z "${KAFKA_JAVA_CLIENT_CONFIG:-}" ]; } && [ -f "$ROOT/.stack/env" ]; then
  given=${KAFKA_BOOTSTRAP_SERVERS:-}
  # shellcheck disable=SC1091
  . "$ROOT/.stack/env"
  KAFKA_BOOTSTRAP_SERVERS=${given:-${KAFKA_BOOTSTRAP_SERVERS:-}}
fi
args=("$@")
case " $* " in
  *" --bootstrap-server "*|*" --bootstrap-server="*|*" --bootstrap-controller "*) ;;
  *)
    [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ] || { echo "kafka.sh: KAFKA_BOOTSTRAP_SERVERS unset and no .stack/env; run make up" >&2; exit 1; }
    args=(--bootstrap-server "$KAFKA_BOOTSTRAP_SERVERS" "${args[@]}") ;;
esac
case " $* " in
  *" --command-config "*|*" --consumer.config "*|*" --producer.config "*) ;;
  *) if [ -n "${KAFKA_JAVA_CLIENT_CONFIG:-}" ]; then args+=("$config_flag" "$KAFKA_JAVA_CLIENT_CONFIG"); fi ;;
esac
exec java -Dlog4j2.configurationFile="$ROOT/scripts/kafka/tools-log4j2.properties" -Djava.awt.headless=true \
  -cp "$LIBS/*" "$main" "${args[@]}"
