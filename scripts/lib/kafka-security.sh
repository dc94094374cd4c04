# Kafka with SASL, TLS and ACLs, sourced by scripts/stack.sh (which sets
# STACK_DIR, KAFKA_DIR, KAFKA_NODES, KAFKA_LIBS, SECURITY, PG_SECRETS,
# node_host, client_port, bootstrap_servers, java_props, log and die, and
# sources scripts/lib/tls.sh), and by compose's scripts/compose/secrets.sh
# for the principals' passwords and client properties.
#
# STACK_SECURITY=tls (the default):
# - every listener is SASL_SSL: the clients' and the brokers' own
#   replication (listener CLIENT) with SCRAM-SHA-512, the KRaft quorum
#   (listener CONTROLLER) with PLAIN, since a controller cannot read SCRAM
#   credentials (they live in the metadata log it serves). SCRAM rather
#   than mutual TLS: a principal is a name and a password the stack makes
#   and rotates like PostgreSQL's, no certificate per client to issue,
#   renew and revoke, and librdkafka, the Java clients and every managed
#   Kafka take it; TLS still encrypts every byte and proves the brokers
#   (one certificate from the stack's CA for every node's address);
# - the principals: `broker` (the nodes to each other) and `controller`
#   (the quorum), super users; `admin` (the tools, the tests), a super user;
#   `relay`, which may only write (and describe) the order.events topics:
#   `order.events` and every topic whose name starts with it, as the
#   experiments' `order.events.<run>`; `payments`, which may only read
#   them and use the consumer groups whose names start with `payments`.
#   StandardAuthorizer, and no ACL means no access
#   (allow.everyone.if.no.acl.found=false): an unauthenticated client, or
#   any other name, is refused;
# - the passwords: 192 random bits each (openssl rand), in
#   $PG_SECRETS/kafka-<principal>.password (0600). The SCRAM credentials
#   are written into the cluster's metadata when its nodes are formatted,
#   from an argument file (java @file, 0600, removed after), never from a
#   process's arguments. Each principal's client config file,
#   $KAFKA_DIR/clients/<principal>.properties (librdkafka's properties,
#   0600, in a 0700 directory), is what a service reads with
#   --kafka-client-config; admin-java.properties is the Java tools' one
#   (scripts/kafka.sh).
# STACK_SECURITY=plaintext: PLAINTEXT listeners, no authorizer, every client
# anyone: the counter-example the cost of TLS and SASL is measured against.
#
# The credentials are in the metadata log, so a cluster formatted in one
# mode is formatted again (its topics lost) when `up` is asked for the
# other.

KAFKA_CLIENTS=$KAFKA_DIR/clients
KAFKA_PRINCIPALS="broker controller admin relay payments"
KAFKA_MECHANISM=SCRAM-SHA-512
# Resource names the services' ACLs cover (prefixed).
KAFKA_ACL_TOPIC_PREFIX=order.events
KAFKA_ACL_GROUP_PREFIX=payments

kafka_password() { cat "$PG_SECRETS/kafka-$1.password"; }

# kafka_secrets: a password per principal, kept across `up`s.
kafka_secrets() {
  (umask 077; mkdir -p "$PG_SECRETS")
  chmod 0700 "$PG_SECRETS"
  local p
  for p in $KAFKA_PRINCIPALS; do
    [ -s "$PG_SECRETS/kafka-$p.password" ] && continue
    (umask 077; openssl rand -hex 24 >"$PG_SECRETS/kafka-$p.password") || die "openssl could not make a password"
  done
}

# kafka_certs: one server certificate for every node's address, and the
# nodes' PEM key store (key and certificate in one file, 0600).
kafka_certs() {
  local san="IP:127.0.0.1,DNS:localhost" n host
  for n in $(seq 1 "$KAFKA_NODES"); do
    host=$(node_host "$n")
    case ",$san," in *",IP:$host,"*) ;; *) san+=",IP:$host" ;; esac
  done
  tls_issue kafka "effectively kafka" "$san"
  (umask 077; mkdir -p "$KAFKA_DIR/tls")
  (umask 077; cat "$TLS_DIR/kafka.key" "$TLS_DIR/kafka.crt" >"$KAFKA_DIR/tls/keystore.pem")
}

# kafka_security_props N: node N's listeners and security, for its
# server.properties.
kafka_security_props() {
  local n=$1 host port cport
  host=$(node_host "$n") port=$(client_port "$n") cport=$(controller_port "$n")
  if [ "$SECURITY" = plaintext ]; then
    cat <<PROPS
listeners=PLAINTEXT://$host:$port,CONTROLLER://$host:$cport
advertised.listeners=PLAINTEXT://$host:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
PROPS
    return
  fi
  local controller broker
  controller=$(kafka_password controller) broker=$(kafka_password broker)
  cat <<PROPS
listeners=CLIENT://$host:$port,CONTROLLER://$host:$cport
advertised.listeners=CLIENT://$host:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=CLIENT
listener.security.protocol.map=CLIENT:SASL_SSL,CONTROLLER:SASL_SSL
sasl.enabled.mechanisms=$KAFKA_MECHANISM
sasl.mechanism.inter.broker.protocol=$KAFKA_MECHANISM
listener.name.client.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="broker" password="$broker";
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="controller" password="$controller" user_controller="$controller";
ssl.keystore.type=PEM
ssl.keystore.location=$KAFKA_DIR/tls/keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$TLS_CA
ssl.client.auth=none
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:broker;User:controller;User:admin
allow.everyone.if.no.acl.found=false
PROPS
}

# kafka_format_scram FILE: the StorageTool arguments that add every SCRAM
# principal, appended to the argument file FILE.
kafka_format_scram() {
  local p
  [ "$SECURITY" = plaintext ] && return
  for p in broker admin relay payments; do
    printf -- '--add-scram\n"%s=[name=%s,password=%s]"\n' "$KAFKA_MECHANISM" "$p" "$(kafka_password "$p")" >>"$1"
  done
}

# write_private FILE: standard input into FILE (0600), whole or not at all
# (a temporary file beside it, renamed).
write_private() {
  local tmp
  tmp=$(umask 077; mktemp "$1.XXXXXX")
  cat >"$tmp" && mv "$tmp" "$1"
}

# librdkafka_properties PRINCIPAL: its librdkafka properties.
librdkafka_properties() {
  echo "# The $1 principal's librdkafka properties (--kafka-client-config); written by scripts/stack.sh or compose's secrets.sh."
  if [ "$SECURITY" = plaintext ]; then
    echo "security.protocol=plaintext"
    return
  fi
  echo "security.protocol=sasl_ssl"
  echo "sasl.mechanism=$KAFKA_MECHANISM"
  echo "sasl.username=$1"
  echo "sasl.password=$(kafka_password "$1")"
  echo "ssl.ca.location=$TLS_CA"
  echo "ssl.endpoint.identification.algorithm=https"
}

# java_admin_properties: the admin principal's properties for Kafka's Java tools.
java_admin_properties() {
  echo "# The admin principal for Kafka's Java tools (scripts/kafka.sh, compose's kafka-init); written by scripts/stack.sh or compose's secrets.sh."
  if [ "$SECURITY" = plaintext ]; then
    echo "security.protocol=PLAINTEXT"
    return
  fi
  echo "security.protocol=SASL_SSL"
  echo "sasl.mechanism=$KAFKA_MECHANISM"
  echo "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"admin\" password=\"$(kafka_password admin)\";"
  echo "ssl.truststore.type=PEM"
  echo "ssl.truststore.location=$TLS_CA"
}

# kafka_client_files: each principal's librdkafka properties, and the Java
# tools' admin properties.
kafka_client_files() {
  (umask 077; mkdir -p "$KAFKA_CLIENTS")
  chmod 0700 "$KAFKA_CLIENTS"
  local p
  for p in admin relay payments; do
    librdkafka_properties "$p" | write_private "$KAFKA_CLIENTS/$p.properties"
  done
  java_admin_properties | write_private "$KAFKA_CLIENTS/admin-java.properties"
}

# kafka_acl ARGS...: Kafka's AclCommand as the admin principal.
kafka_acl() {
  # shellcheck disable=SC2046
  java $(java_props "$ROOT/scripts/kafka/tools-log4j2.properties") -cp "$KAFKA_LIBS/*" org.apache.kafka.tools.AclCommand \
    --bootstrap-server "$(bootstrap_servers)" --command-config "$KAFKA_CLIENTS/admin-java.properties" "$@"
}

# kafka_acls: the services' ACLs, once per cluster (they live in its
# metadata log), again when this script changes them.
kafka_acls() {
  [ "$SECURITY" = plaintext ] && return
  local spec="relay:Write,Describe,DescribeConfigs:topic:$KAFKA_ACL_TOPIC_PREFIX payments:Read,Describe,DescribeConfigs:topic:$KAFKA_ACL_TOPIC_PREFIX payments:Read:group:$KAFKA_ACL_GROUP_PREFIX"
  [ "$(cat "$KAFKA_DIR/acls" 2>/dev/null)" = "$spec" ] && return
  log "kafka: granting the relay and payments their ACLs"
  local entry principal ops kind name op args
  for entry in $spec; do
    IFS=: read -r principal ops kind name <<<"$entry"
    args=()
    for op in ${ops//,/ }; do args+=(--operation "$op"); done
    kafka_acl --add --allow-principal "User:$principal" "${args[@]}" "--$kind" "$name" \
      --resource-pattern-type prefixed >>"$LOGS/kafka-acls.log" 2>&1 \
      || die "kafka: could not grant $principal its ACLs on $kind $name*, see $LOGS/kafka-acls.log"
  done
  echo "$spec" >"$KAFKA_DIR/acls"
}

# kafka_security_env: the lines of the env file that name each principal's
# client config file.
kafka_security_env() {
  cat <<ENV
# Kafka (STACK_SECURITY=$SECURITY): SASL_SSL with SCRAM-SHA-512, one principal per service, ACLs.
# KAFKA_CLIENT_CONFIG is the admin's (the tools, the tests); each service runs with its own.
export KAFKA_CLIENT_CONFIG=$KAFKA_CLIENTS/admin.properties
export RELAY_KAFKA_CLIENT_CONFIG=$KAFKA_CLIENTS/relay.properties
export PAYMENTS_KAFKA_CLIENT_CONFIG=$KAFKA_CLIENTS/payments.properties
export KAFKA_JAVA_CLIENT_CONFIG=$KAFKA_CLIENTS/admin-java.properties
ENV
}
