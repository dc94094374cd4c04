//! The infrastructure faults chaos injects (`--fault`): what each does, and
//! what it needs of the stack.

use clap::ValueEnum;

/// An infrastructure fault (`--fault`). Chaos injects it and does not
/// restart the services for it: they must recover by themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// PostgreSQL stopped with `-m immediate` (a crash: no checkpoint, every
    /// connection cut), down for `--fault-down-ms`, then started again
    /// (`STACK_SCRIPT crash postgres`).
    PgCrash,
    /// The PostgreSQL cluster's primary lost (`STACK_PG=ha`): its Patroni
    /// and postmaster kill -9'd, so the leader key expires and Patroni
    /// promotes the synchronous standby; HAProxy then sends connections
    /// there. The old node starts again once the new primary takes writes
    /// and `--fault-down-ms` is over, and rejoins as a replica
    /// (`STACK_SCRIPT pg failover`).
    PgFailover,
    /// The same with the standbys behind first: the primary's WAL senders
    /// to its standbys stopped (SIGSTOP) for `--pg-lag-ms`, then the primary
    /// lost as in pg-failover (`STACK_SCRIPT pg failover DOWN_MS LAG_MS`).
    /// Synchronous, no commit returns while they are stopped, so none that
    /// returned is lost; asynchronous (`STACK_PG_SYNC=off`), the primary goes
    /// on acknowledging commits no standby has, and the promoted one never
    /// has them: the counter-example.
    PgLaggedFailover,
    /// A planned switchover of the cluster's primary to the synchronous
    /// standby (`STACK_SCRIPT pg switchover`, patronictl).
    PgSwitchover,
    /// The cluster's synchronous standby kill -9'd with its Patroni for
    /// `--fault-down-ms` (`STACK_SCRIPT pg standby-loss`): commits wait until
    /// Patroni names the other replica synchronous.
    PgStandbyLoss,
    /// The cluster's primary cut off from etcd and the other nodes for
    /// `--pg-partition-ms`, still running and still reached by HAProxy
    /// (`STACK_SCRIPT pg partition`, firewall rules on the nodes' cgroups;
    /// root). Its Patroni cannot renew the leader key and demotes it; once
    /// the key's TTL is out the synchronous standby is promoted. The note
    /// says when each happened and whether two nodes were ever primaries at
    /// once (a split brain); the old node rewinds and follows after the heal.
    PgPartition,
    /// One Kafka node kill -9'd (the leader of most of the topic's
    /// partitions), down for `--fault-down-ms`, then started again
    /// (`STACK_SCRIPT crash broker`): leaders move to the other two, the
    /// relay's unacked sends are retried there.
    BrokerKill,
    /// Two of the three Kafka nodes kill -9'd at once, down for
    /// `--fault-down-ms`, then started again (`STACK_SCRIPT crash quorum`):
    /// no partition can reach `min.insync.replicas`, so no send is acked;
    /// the relay backs off with its rows pending (nothing is marked
    /// published that was not acked) until both are back.
    BrokerQuorumLoss,
    /// One Kafka node SIGSTOPped for `--broker-pause-ms` (longer than the
    /// brokers' `replica.lag.time.max.ms`, 10 s on the stack, so it leaves
    /// the ISR of its partitions), then SIGCONTed (`STACK_SCRIPT pause
    /// broker`): it catches up and rejoins the ISR.
    BrokerPause,
    /// The relay SIGSTOPped for `--relay-pause-ms` (longer than its
    /// idle-in-transaction limit, so a transaction it held is cut), then
    /// SIGCONTed.
    RelayPause,
    /// The consumer group's committed offsets reset to the earliest: a full
    /// redelivery. Kafka accepts a reset only from outside an empty group, so
    /// payments is stopped (SIGTERM), the offsets are committed as the
    /// group's (`kafka-tool offsets reset`), and payments is started again.
    OffsetReset,
    /// The payments group scaled to the next count of `--payments-scale`
    /// (in turn: 1, 6, 2, 6, ...): instances past it stopped (SIGTERM, a
    /// clean leave), those below started, so partitions move with batches in
    /// flight. It waits until the group has settled (all `--partitions`
    /// owned, each member with its share), then its outage runs until the
    /// group has settled on the running members (the moved partitions had
    /// no consumer for part of it); the record names the step and the inbox hits (re-reads)
    /// until the pipeline moved again. Needs `--payments` of at least 2.
    PaymentsScale,
    /// `--transport http`: the webhook receiver (payments) stopped for
    /// `--fault-down-ms`, then started again; the sender's attempts fail
    /// meanwhile and are retried on its schedule.
    ReceiverDown,
    /// `--transport http`: chaos's proxy answers every webhook 500 for
    /// `--fault-down-ms`, without passing it on.
    ReceiverErrors,
    /// `--transport http`: chaos's proxy holds every webhook past the
    /// sender's timeout (`--webhook-timeout-ms` + 1 s) for `--fault-down-ms`,
    /// then passes it on: the receiver applies it, the sender has given up on
    /// the attempt, and its retry is a duplicate.
    ReceiverSlow,
    /// A partitioned leader: the Kafka node that leads most of the topic's
    /// partitions drops every packet to and from the other two nodes for
    /// `--net-fault-ms`, while clients still reach it (`STACK_SCRIPT net
    /// partition`). Its followers fall out of sync, the controller moves
    /// leadership away; a send it took meanwhile cannot reach
    /// `min.insync.replicas` and is retried elsewhere. Needs the cluster in
    /// network namespaces (`STACK_NET=netns`).
    BrokerPartition,
    /// Every TCP packet between the services and the Kafka nodes held back
    /// (a round trip longer by a draw from `--net-delay-ms`) and some dropped
    /// (a draw from `--net-loss-pct`, each way) for `--net-fault-ms`, by
    /// chaos's own delay line on an NFQUEUE (`STACK_SCRIPT net lag`; the
    /// kernels here have no netem). Needs `STACK_NET=netns`.
    NetLag,
    /// One relay instance (one that published just before, so it holds shard
    /// leases) cut off from every Kafka node for `--net-fault-ms`, while it
    /// still reaches PostgreSQL and so keeps its leases (`STACK_SCRIPT net
    /// cut`, on the instance's own cgroup): its sends time out and its rows
    /// stay pending, none is marked published.
    RelayCut,
    /// One payments instance (one that consumed just before) cut off from
    /// PostgreSQL for `--net-fault-ms`, with its transactions in flight; its
    /// Kafka session goes on, so it keeps its partitions and nothing of them
    /// is applied until the cut heals.
    PaymentsDbCut,
}

impl Fault {
    /// The name `--fault` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PgCrash => "pg-crash",
            Self::PgFailover => "pg-failover",
            Self::PgLaggedFailover => "pg-lagged-failover",
            Self::PgSwitchover => "pg-switchover",
            Self::PgStandbyLoss => "pg-standby-loss",
            Self::PgPartition => "pg-partition",
            Self::BrokerKill => "broker-kill",
            Self::BrokerQuorumLoss => "broker-quorum-loss",
            Self::BrokerPause => "broker-pause",
            Self::RelayPause => "relay-pause",
            Self::OffsetReset => "offset-reset",
            Self::PaymentsScale => "payments-scale",
            Self::ReceiverDown => "receiver-down",
            Self::ReceiverErrors => "receiver-errors",
            Self::ReceiverSlow => "receiver-slow",
            Self::BrokerPartition => "broker-partition",
            Self::NetLag => "net-lag",
            Self::RelayCut => "relay-cut",
            Self::PaymentsDbCut => "payments-db-cut",
        }
    }

    /// Whether this fault cuts one instance off (each instance then runs in
    /// a cgroup of its own, which the firewall rule matches).
    pub fn cuts_one_instance(self) -> bool {
        matches!(self, Self::RelayCut | Self::PaymentsDbCut)
    }

    /// Whether this fault needs the Kafka nodes in network namespaces
    /// (`STACK_NET=netns`).
    pub fn needs_netns(self) -> bool {
        matches!(self, Self::BrokerPartition | Self::NetLag)
    }

    /// Whether this is a network fault (root, iptables; `SCRIPT net heal`
    /// removes its rules).
    pub fn is_network(self) -> bool {
        self.cuts_one_instance() || self.needs_netns() || self == Self::PgPartition
    }

    /// Whether this fault acts on PostgreSQL (the cluster's faults, and
    /// pg-crash: on the cluster, the primary's postmaster).
    pub fn touches_pg(self) -> bool {
        self == Self::PgCrash || self.needs_pg_cluster()
    }

    /// Whether this fault needs the PostgreSQL cluster (`STACK_PG=ha`).
    pub fn needs_pg_cluster(self) -> bool {
        matches!(
            self,
            Self::PgFailover
                | Self::PgLaggedFailover
                | Self::PgSwitchover
                | Self::PgStandbyLoss
                | Self::PgPartition
        )
    }

    /// Whether this fault exists only with `--transport http`.
    pub fn needs_http(self) -> bool {
        matches!(
            self,
            Self::ReceiverDown | Self::ReceiverErrors | Self::ReceiverSlow
        )
    }
}
