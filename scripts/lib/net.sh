# The stack's network, sourced by scripts/stack.sh (which sets STACK_DIR,
# KAFKA_DIR, KAFKA_NODES, PG_PORT, log, die, ms_to_s and apt_install).
#
# STACK_NET=loopback (the default): every Kafka node listens on 127.0.0.1.
# STACK_NET=netns: node N runs in its own network namespace, on its own
# address PREFIX.(10+N) (STACK_NET_PREFIX, default 10.213.7), behind a veth
# pair whose other end is on a bridge that holds PREFIX.1 in the root
# namespace, where PostgreSQL and the services run. Only these test hosts
# are ever addressed; `down` removes the namespaces, the veth pairs and the
# bridge. Root only (it creates namespaces and firewall rules).
#
# The mode is the cluster's: `up` records it in $KAFKA_DIR/net and every
# later command (crash, pause, net, status, a plain `up`) reads it from
# there, so chaos's fault commands find the nodes where they run.
# STACK_NET given to `up` and different from the recorded mode restarts the
# cluster in the new mode on fresh storage (the topic is created again).
#
# The network faults (`scripts/stack.sh net …`, chaos --fault) are
# iptables rules in chains of their own, so that `net heal` (and `down`)
# removes every one of them and nothing else:
#   net partition MS [NODE]  node NODE (the busiest leader by default) drops
#                            every packet to and from the other nodes for MS,
#                            still serving clients: a partitioned leader
#                            (netns)
#   net lag on|off QUEUE     every TCP packet between the root namespace and
#                            the nodes goes through NFQUEUE number QUEUE,
#                            where chaos's delay line holds it and drops some
#                            (this kernel has no netem); a queue nobody reads
#                            passes packets through (--queue-bypass) (netns)
#   net cut CGROUP brokers|postgres MS
#                            the processes of cgroup v2 group CGROUP (a path
#                            under the cgroup2 root, as chaos makes them) get
#                            none of their packets through to the Kafka nodes
#                            or to PostgreSQL for MS; the rest of the stack is
#                            untouched (both modes)
#   net heal                 remove every rule above now
#   net check [netns]        whether these can be made here (root,
#                            iptables; netns: the cluster in namespaces)

NET_PREFIX_DEFAULT=10.213.7
# Names carry a short hash of STACK_DIR: two stacks (a CI clone beside a
# checkout) never share a namespace, a bridge or a chain.
NET_ID=$(printf %s "$STACK_DIR" | sha256sum | cut -c1-4)
NET_CHAIN=EFF-$NET_ID

# The recorded mode, or loopback; NET_PREFIX with it.
net_load() {
  NET=loopback NET_PREFIX=${STACK_NET_PREFIX:-$NET_PREFIX_DEFAULT}
  if [ -f "$KAFKA_DIR/net" ]; then read -r NET NET_PREFIX <"$KAFKA_DIR/net"; fi
  NET_PREFIX=${NET_PREFIX:-$NET_PREFIX_DEFAULT}
}

net_check_request() {
  local want=${STACK_NET:-}
  [ -z "$want" ] || [[ $want =~ ^(loopback|netns)$ ]] || die "STACK_NET must be loopback or netns, got '$want'"
  local prefix=${STACK_NET_PREFIX:-$NET_PREFIX_DEFAULT}
  [[ $prefix =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "STACK_NET_PREFIX must be three octets (10.213.7), got '$prefix'"
}

net_bridge() { echo "eff${NET_ID}br"; }
node_ns() { echo "eff-$NET_ID-k$1"; }
node_veth() { echo "eff${NET_ID}k$1"; }

# Where node N listens, in the recorded mode.
node_host() {
  if [ "$NET" = netns ]; then echo "$NET_PREFIX.$((10 + $1))"; else echo 127.0.0.1; fi
}

# The command prefix that runs something in node N's namespace (none on loopback).
node_exec() {
  if [ "$NET" = netns ]; then echo "ip netns exec $(node_ns "$1")"; fi
}

ensure_net_tools() {
  [ "$(id -u)" = 0 ] || die "the network (STACK_NET=netns, net faults) needs root: it creates namespaces and firewall rules"
  command -v ip >/dev/null 2>&1 || die "ip (iproute2) not found"
  if ! command -v iptables >/dev/null 2>&1; then
    apt_install iptables
    command -v iptables >/dev/null 2>&1 || die "iptables still missing after apt-get install"
  fi
}

# The bridge, and each node's namespace and veth pair (idempotent).
net_up() {
  [ "$NET" = netns ] || return 0
  ensure_net_tools
  local br n ns veth
  br=$(net_bridge)
  if ! ip link show "$br" >/dev/null 2>&1; then
    ip route get "$NET_PREFIX.1" 2>/dev/null | grep -q "dev lo\|local" \
      && die "$NET_PREFIX.1 is already an address of this machine; set STACK_NET_PREFIX"
    ip link add "$br" type bridge
    ip addr add "$NET_PREFIX.1/24" dev "$br"
    ip link set "$br" up
  fi
  for n in $(seq 1 "$KAFKA_NODES"); do
    ns=$(node_ns "$n") veth=$(node_veth "$n")
    [ -e "/var/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name eth0 netns "$ns"
      ip link set "$veth" master "$br" up
      ip -n "$ns" addr add "$(node_host "$n")/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$ns" link set lo up
    fi
  done
  log "network: $KAFKA_NODES namespaces on $NET_PREFIX.0/24 (bridge $br at $NET_PREFIX.1)"
}

# Removes the namespaces, veth pairs and bridge of this stack (the nodes must
# be stopped first), and every fault rule.
net_down() {
  net_heal_all quiet
  local n ns br
  for n in 1 2 3; do
    ns=$(node_ns "$n")
    [ -e "/var/run/netns/$ns" ] && ip netns del "$ns"
  done
  br=$(net_bridge)
  if ip link show "$br" >/dev/null 2>&1; then
    ip link del "$br"
    log "network removed (namespaces, veth pairs, bridge $br)"
  fi
  return 0
}

# iptables in network namespace NS, or the root namespace's when NS is
# empty: ipt NS ARGS…
ipt() {
  local ns=$1
  shift
  if [ -n "$ns" ]; then ip netns exec "$ns" iptables -w "$@"; else iptables -w "$@"; fi
}

# CHAIN exists in NS and INPUT and OUTPUT jump to it: chain_hook NS CHAIN
chain_hook() {
  local ns=$1 chain=$2 hook
  ipt "$ns" -N "$chain" 2>/dev/null || true
  for hook in INPUT OUTPUT; do
    ipt "$ns" -C "$hook" -j "$chain" 2>/dev/null || ipt "$ns" -I "$hook" -j "$chain"
  done
}

# CHAIN gone from NS, with the jumps to it: chain_drop NS CHAIN
chain_drop() {
  local ns=$1 chain=$2 hook
  ipt "$ns" -S "$chain" >/dev/null 2>&1 || return 0
  for hook in INPUT OUTPUT; do
    while ipt "$ns" -D "$hook" -j "$chain" 2>/dev/null; do :; done
  done
  ipt "$ns" -F "$chain"
  ipt "$ns" -X "$chain"
}

net_heal_all() {
  command -v iptables >/dev/null 2>&1 || return 0
  [ "$(id -u)" = 0 ] || return 0
  local n
  chain_drop "" "$NET_CHAIN-LAG"
  chain_drop "" "$NET_CHAIN-CUT"
  chain_drop "" "$NET_CHAIN-PG"
  for n in 1 2 3; do
    [ -e "/var/run/netns/$(node_ns "$n")" ] && chain_drop "$(node_ns "$n")" "$NET_CHAIN-PART"
  done
  [ "${1:-}" = quiet ] || log "network healed: no fault rule left"
}

net_need_netns() {
  [ "$NET" = netns ] || die "net $1 needs the cluster in its own network namespaces: STACK_NET=netns scripts/stack.sh up"
  ensure_net_tools
}

# Node N drops everything to and from the other nodes for MS.
net_partition() {
  local ms=${1:-15000} n=${2:-} other ns
  [[ $ms =~ ^[0-9]+$ ]] || die "MS must be a number of milliseconds, got '$ms'"
  net_need_netns partition
  [ "$KAFKA_NODES" = 3 ] || die "net partition needs the 3-node cluster"
  ensure_kafka
  local t0 lookup_ms
  t0=$(date +%s%3N)
  [ -n "$n" ] || n=$(busiest_leader)
  lookup_ms=$(( $(date +%s%3N) - t0 ))
  [[ $n =~ ^[1-3]$ ]] || die "NODE must be 1..3, got '$n'"
  ns=$(node_ns "$n")
  chain_hook "$ns" "$NET_CHAIN-PART"
  for other in 1 2 3; do
    [ "$other" = "$n" ] && continue
    ipt "$ns" -A "$NET_CHAIN-PART" -s "$(node_host "$other")" -j DROP
    ipt "$ns" -A "$NET_CHAIN-PART" -d "$(node_host "$other")" -j DROP
  done
  log "kafka node $n partitioned from the other nodes for $ms ms (clients still reach it)"
  sleep "$(ms_to_s "$ms")"
  chain_drop "$ns" "$NET_CHAIN-PART"
  log "kafka node $n rejoined the network"
  # What chaos notes: the node, and how long finding it took (Kafka's own
  # tool, a JVM: seconds on a loaded machine), which the fault's outage includes.
  echo "kafka node $n, found in $lookup_ms ms"
}

# The delay line's queue: TCP between the root namespace and every node.
net_lag() {
  local what=${1:-} queue=${2:-} n h
  [[ $queue =~ ^[0-9]+$ ]] && [ "$queue" -le 65535 ] || die "QUEUE must be a queue number 0..65535, got '$queue'"
  net_need_netns lag
  case "$what" in
    on)
      chain_hook "" "$NET_CHAIN-LAG"
      for n in $(seq 1 "$KAFKA_NODES"); do
        h=$(node_host "$n")
        ipt "" -A "$NET_CHAIN-LAG" -p tcp -d "$h" -j NFQUEUE --queue-num "$queue" --queue-bypass
        ipt "" -A "$NET_CHAIN-LAG" -p tcp -s "$h" -j NFQUEUE --queue-num "$queue" --queue-bypass
      done
      log "traffic to and from the kafka nodes goes through NFQUEUE $queue" ;;
    off)
      chain_drop "" "$NET_CHAIN-LAG"
      log "traffic to and from the kafka nodes flows directly again" ;;
    *) die "net lag on|off QUEUE, got '$what'" ;;
  esac
}

# The processes of cgroup CGROUP get no packet through to TARGET for MS.
net_cut() {
  local cgroup=${1:-} target=${2:-} ms=${3:-15000} n rules=()
  [ -n "$cgroup" ] || die "net cut CGROUP brokers|postgres MS: CGROUP missing"
  [[ $ms =~ ^[0-9]+$ ]] || die "MS must be a number of milliseconds, got '$ms'"
  ensure_net_tools
  case "$target" in
    brokers)
      for n in $(seq 1 "$KAFKA_NODES"); do
        rules+=("-p tcp -d $(node_host "$n") --dport $(client_port "$n")")
      done ;;
    postgres) rules+=("-p tcp -d 127.0.0.1 --dport $PG_PORT") ;;
    *) die "net cut: brokers or postgres, got '$target'" ;;
  esac
  chain_hook "" "$NET_CHAIN-CUT"
  local r
  for r in "${rules[@]}"; do
    # shellcheck disable=SC2086 # r is a rule's words
    ipt "" -A "$NET_CHAIN-CUT" -m cgroup --path "$cgroup" $r -j DROP \
      || die "iptables refused the cut of cgroup $cgroup (is it a cgroup v2 path that exists?)"
  done
  log "cgroup $cgroup cut off from $target for $ms ms"
  sleep "$(ms_to_s "$ms")"
  for r in "${rules[@]}"; do
    # shellcheck disable=SC2086
    ipt "" -D "$NET_CHAIN-CUT" -m cgroup --path "$cgroup" $r -j DROP 2>/dev/null || true
  done
  log "cgroup $cgroup reaches $target again"
}

net_status() {
  if [ "$NET" = netns ]; then echo "network: netns ($NET_PREFIX.0/24, bridge $(net_bridge))"; else echo "network: loopback"; fi
  if command -v iptables >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    iptables -w -S "$NET_CHAIN-LAG" 2>/dev/null | grep -q NFQUEUE && echo "network fault: lag (NFQUEUE)"
    iptables -w -S "$NET_CHAIN-CUT" 2>/dev/null | grep -- '-j DROP' | sed 's/^/network fault: cut /'
  fi
  return 0
}

net_cmd() {
  local what=${1:-}
  shift || true
  case "$what" in
    partition) net_partition "$@" ;;
    lag) net_lag "$@" ;;
    cut) net_cut "$@" ;;
    heal) net_heal_all ;;
    check)
      # What chaos asks before a run with network faults: can they be made?
      if [ "${1:-}" = netns ]; then net_need_netns "faults on the brokers' network"; else ensure_net_tools; fi
      log "network faults: ready ($NET)" ;;
    status) net_status ;;
    *) die "net partition MS [NODE] | lag on|off QUEUE | cut CGROUP brokers|postgres MS | heal | check [netns] | status, got '$what'" ;;
  esac
}
