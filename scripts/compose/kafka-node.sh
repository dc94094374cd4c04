#!/usr/bin/env bash
# A compose Kafka node (docker-compose.yml, image apache/kafka): writes its
# server.properties from the environment and its secrets (/secrets, made by
# compose/secrets.sh), formats its storage on the first start with the SCRAM
# principals, then runs the node. The listeners and principals are the
# embedded stack's (scripts/lib/kafka-security.sh):
# - INTERNAL (kafka-N:29092: the containers, and the nodes' replication) and
#   HOST (127.0.0.1:1909N: the host's binaries) are SASL_SSL with
#   SCRAM-SHA-512; CONTROLLER (the KRaft quorum, kafka-N:9093) is SASL_SSL
#   with PLAIN, since a controller cannot read SCRAM credentials (they live
#   in the metadata log it serves);
# - StandardAuthorizer, and no ACL means no access; broker, controller and
#   admin are super users; kafka-init grants relay and payments theirs.
#
# Environment: NODE_ID (1..3), HOST_PORT (its published port), CLUSTER_ID,
# KAFKA_HOME (/opt/kafka), KAFKA_DATA (/var/lib/kafka/data), SECRETS
# (/secrets), GROUP_SESSIONS (/kafka/group-sessions.properties, the
# project's scripts/kafka/group-sessions.properties), and KAFKA_CONF, a folder for server.properties (0600: it holds
# the broker's and the controller's passwords; default a private temp folder).
set -euo pipefail
: "${NODE_ID:?NODE_ID is this node's id, 1 to 3}" "${HOST_PORT:?HOST_PORT is its port on the host}" "${CLUSTER_ID:?CLUSTER_ID is the cluster's id}"
KAFKA_HOME=${KAFKA_HOME:-/opt/kafka}
KAFKA_DATA=${KAFKA_DATA:-/var/lib/kafka/data}
SECRETS=${SECRETS:-/secrets}
GROUP_SESSIONS=${GROUP_SESSIONS:-/kafka/group-sessions.properties}
MECHANISM=SCRAM-SHA-512
umask 077
KAFKA_CONF=${KAFKA_CONF:-$(mktemp -d)}
CONF=$KAFKA_CONF/server.properties

secret() {
  [ -s "$SECRETS/$1.password" ] || { echo "kafka-node: $SECRETS/$1.password is missing (the secrets service makes it)" >&2; exit 1; }
  cat "$SECRETS/$1.password"
}
broker=$(secret broker) controller=$(secret controller)

cat >"$CONF" <<PROPS
# Written by compose/kafka-node.sh at each start.
node.id=$NODE_ID
process.roles=broker,controller
controller.quorum.voters=1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093
log.dirs=$KAFKA_DATA
listeners=INTERNAL://:29092,CONTROLLER://:9093,HOST://:9092
advertised.listeners=INTERNAL://kafka-$NODE_ID:29092,HOST://127.0.0.1:$HOST_PORT
listener.security.protocol.map=INTERNAL:SASL_SSL,HOST:SASL_SSL,CONTROLLER:SASL_SSL
inter.broker.listener.name=INTERNAL
controller.listener.names=CONTROLLER
sasl.enabled.mechanisms=$MECHANISM
sasl.mechanism.inter.broker.protocol=$MECHANISM
listener.name.internal.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="broker" password="$broker";
listener.name.host.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="controller" password="$controller" user_controller="$controller";
ssl.keystore.type=PEM
ssl.keystore.location=$SECRETS/keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$SECRETS/ca.crt
ssl.client.auth=none
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:broker;User:controller;User:admin
allow.everyone.if.no.acl.found=false
auto.create.topics.enable=false
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
PROPS
# Group sessions as the embedded stack's.
cat "$GROUP_SESSIONS" >>"$CONF"

if [ ! -f "$KAFKA_DATA/meta.properties" ]; then
  # The SCRAM principals' passwords go in an argument file (java @file),
  # never in a process's arguments.
  args=$(mktemp "$KAFKA_CONF/format-args.XXXXXX")
  printf '%s\n' kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$CONF" >"$args"
  for p in broker admin relay payments; do
    printf -- '--add-scram\n"%s=[name=%s,password=%s]"\n' "$MECHANISM" "$p" "$(secret "$p")" >>"$args"
  done
  java -cp "$KAFKA_HOME/libs/*" @"$args" || { rm -f "$args"; echo "kafka-node: formatting node $NODE_ID failed" >&2; exit 1; }
  rm -f "$args"
fi
exec "$KAFKA_HOME/bin/kafka-server-start.sh" "$CONF"
