use std::collections::BTreeSet;

use stateright::{Model, Property};

use crate::config::{Config, Consume, Fence, Write};
use crate::state::{
    Action, Client, Kind, LEASE_EXPIRY, ORDERS_CRASH, PAYMENTS_CRASH, PayStage, Phase, REDELIVERY,
    RELAY_CRASH, RelayStage, Req, Row, Stage, State, u,
};

/// The model: a [`Config`].
#[derive(Debug, Clone)]
pub struct Pipeline(pub Config);

impl Pipeline {
    pub(crate) fn cfg(&self) -> &Config {
        &self.0
    }

    /// Whether no step is enabled.
    pub fn is_terminal(&self, state: &State) -> bool {
        let mut actions = Vec::new();
        self.actions(state, &mut actions);
        actions.is_empty()
    }

    /// Whether client `key` is done with its key: answered, or failed with
    /// no retry left, and no request of its key is open.
    fn key_done(&self, s: &State, key: u8) -> bool {
        let c = &s.clients[usize::from(key)];
        let done = match c.phase {
            Phase::Acked(_) => true,
            Phase::Failed => c.retries_left == 0,
            Phase::Idle | Phase::Waiting => false,
        };
        done && !s.reqs.iter().any(|r| r.key == key)
    }

    /// Whether message `msg` can never reach payments again: the real
    /// system's redelivery horizon has passed for it.
    fn beyond_horizon(&self, s: &State, msg: u8) -> bool {
        let cfg = self.cfg();
        let p = s.partition(cfg, msg);
        if s.pay == (PayStage::Half { msg }) || s.pay == (PayStage::Fetched { msg }) {
            return false;
        }
        if !cfg.inbox_covers_horizon {
            // (d): the retention counts from the offset commit.
            let from = usize::from(s.committed[p]);
            return !s.log[p][from.min(s.log[p].len())..].contains(&msg);
        }
        let retained = usize::from(s.log_start[p]);
        let on_log = s.log[p][retained..].contains(&msg);
        let row = s.outbox.iter().position(|r| r.msg == msg);
        let republishable = row.is_some_and(|i| {
            !s.outbox[i].published
                || s.relays.iter().any(|r| match *r {
                    RelayStage::Claimed { row, .. } | RelayStage::Published { row, .. } => {
                        usize::from(row) == i
                    }
                    RelayStage::Idle => false,
                })
        });
        let orders_may_publish = s
            .reqs
            .iter()
            .any(|r| matches!(r.stage, Stage::Published { msg: m, .. } if m == msg));
        !on_log && !republishable && !orders_may_publish
    }

    /// The first of orders' writes for a request.
    fn commit(&self, s: &mut State, i: usize) {
        let cfg = self.cfg();
        let Req { key, stage } = s.reqs[i];
        debug_assert_eq!(stage, Stage::Received);
        let k = usize::from(key);
        if let Some(order) = s.keys[k] {
            // The key is taken: its stored response is replayed.
            s.reqs[i].stage = Stage::Committed { order };
        } else {
            let order = s.next_order;
            s.next_order += 1;
            match cfg.write {
                Write::Outbox => {
                    s.keys[k] = Some(order);
                    s.orders.push((order, key));
                    let msg = s.new_msg(order, Kind::Created);
                    s.outbox.push(Row {
                        msg,
                        published: false,
                    });
                    s.reqs[i].stage = Stage::Committed { order };
                }
                Write::PublishFirst => {
                    let msg = s.new_msg(order, Kind::Created);
                    let p = s.partition(cfg, msg);
                    s.log[p].push(msg);
                    s.reqs[i].stage = Stage::Published { order, msg };
                }
                Write::SaveFirst => {
                    s.keys[k] = Some(order);
                    s.orders.push((order, key));
                    s.reqs[i].stage = Stage::Saved { order };
                }
            }
        }
        s.reqs.sort();
    }

    fn second_write(&self, s: &mut State, i: usize) {
        let cfg = self.cfg();
        let Req { key, stage } = s.reqs[i];
        let k = usize::from(key);
        match stage {
            Stage::Published { order, .. } => {
                // The commit, after the publish: a taken key replays (the
                // published message's order never commits).
                let order = match s.keys[k] {
                    Some(existing) => existing,
                    None => {
                        s.keys[k] = Some(order);
                        s.orders.push((order, key));
                        s.orders.sort();
                        order
                    }
                };
                s.reqs[i].stage = Stage::Committed { order };
            }
            Stage::Saved { order } => {
                let msg = s.new_msg(order, Kind::Created);
                let p = s.partition(cfg, msg);
                s.log[p].push(msg);
                s.reqs[i].stage = Stage::Committed { order };
            }
            Stage::Received | Stage::Committed { .. } => {}
        }
        s.reqs.sort();
    }

    /// Payments' transaction for `msg` (inbox claim + effect), as the
    /// variant runs its first step.
    fn apply(&self, s: &mut State, p: usize) {
        let msg = s.log[p][usize::from(s.position[p])];
        s.position[p] += 1;
        match self.cfg().consume {
            Consume::Atomic => {
                if s.claim_inbox(msg) {
                    s.apply_effect(msg);
                }
            }
            Consume::SplitInboxFirst => {
                if s.claim_inbox(msg) {
                    s.pay = PayStage::Half { msg };
                }
            }
            Consume::SplitEffectFirst => {
                if s.inbox.binary_search(&msg).is_err() {
                    s.apply_effect(msg);
                    s.pay = PayStage::Half { msg };
                }
            }
            Consume::OffsetsFirst => {
                s.committed[p] = s.position[p];
                s.pay = PayStage::Fetched { msg };
            }
        }
    }

    fn finish(&self, s: &mut State) {
        match (self.cfg().consume, s.pay) {
            (Consume::SplitInboxFirst, PayStage::Half { msg }) => s.apply_effect(msg),
            (Consume::SplitEffectFirst, PayStage::Half { msg }) => {
                s.claim_inbox(msg);
            }
            (_, PayStage::Fetched { msg }) if s.claim_inbox(msg) => s.apply_effect(msg),
            _ => {}
        }
        s.pay = PayStage::Idle;
    }

    /// Whether `s` is terminal and some intent lacks its one effect.
    pub(crate) fn ends_badly(&self, s: &State) -> bool {
        if !self.is_terminal(s) {
            return false;
        }
        s.orders.iter().any(|&(order, key)| {
            let cancelled = s.clients[usize::from(key)].cancelled;
            s.count_effects(order, Kind::Created) != 1
                || (cancelled && s.count_effects(order, Kind::Cancelled) != 1)
        })
    }
}

impl Model for Pipeline {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let c = self.cfg();
        let n = usize::from(c.clients);
        let p = usize::from(c.partitions.max(1));
        vec![State {
            clients: vec![
                Client {
                    phase: Phase::Idle,
                    retries_left: c.retries,
                    second_order: false,
                    cancelled: false,
                };
                n
            ],
            reqs: Vec::new(),
            keys: vec![None; n],
            orders: Vec::new(),
            next_order: 0,
            msgs: Vec::new(),
            outbox: Vec::new(),
            lease: None,
            epoch: 0,
            relays: vec![RelayStage::Idle; usize::from(c.relays)],
            log: vec![Vec::new(); p],
            log_start: vec![0; p],
            position: vec![0; p],
            committed: vec![0; p],
            pay: PayStage::Idle,
            inbox: Vec::new(),
            effects: Vec::new(),
            budget: [
                c.orders_crashes,
                c.relay_crashes,
                c.payments_crashes,
                c.lease_expiries,
                c.redeliveries,
            ],
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let cfg = self.cfg();
        // Clients.
        for (k, c) in s.clients.iter().enumerate() {
            let k = u(k);
            match c.phase {
                Phase::Idle => actions.push(Action::Send(k)),
                Phase::Waiting | Phase::Failed if c.retries_left > 0 => {
                    actions.push(Action::Retry(k));
                }
                Phase::Acked(_) if cfg.cancel && k == 0 && !c.cancelled => {
                    actions.push(Action::Cancel(k));
                }
                _ => {}
            }
        }
        // Orders.
        let mut seen = BTreeSet::new();
        for (i, r) in s.reqs.iter().enumerate() {
            if !seen.insert(*r) {
                continue; // an identical request: the same successor
            }
            let i = u(i);
            match r.stage {
                Stage::Received => actions.push(Action::Commit(i)),
                Stage::Published { .. } | Stage::Saved { .. } => {
                    actions.push(Action::SecondWrite(i));
                }
                Stage::Committed { .. } => actions.push(Action::Answer(i)),
            }
        }
        if !s.reqs.is_empty() && s.budget[ORDERS_CRASH] > 0 {
            actions.push(Action::OrdersCrash);
        }
        for (k, key) in s.keys.iter().enumerate() {
            let k8 = u(k);
            if cfg.expiry && key.is_some() && self.key_done(s, k8) {
                actions.push(Action::KeyExpire(k8));
            }
        }
        // Relays.
        for (r, stage) in s.relays.iter().enumerate() {
            let r8 = u(r);
            match stage {
                RelayStage::Idle => {
                    if s.lease.is_none() && s.claimable().is_some() {
                        actions.push(Action::Acquire(r8));
                    } else if s.lease.is_some_and(|(h, _)| h == r8) && s.claimable().is_some() {
                        actions.push(Action::Claim(r8));
                    }
                }
                RelayStage::Claimed { .. } => actions.push(Action::Publish(r8)),
                RelayStage::Published { .. } => actions.push(Action::Mark(r8)),
            }
            if *stage != RelayStage::Idle && s.budget[RELAY_CRASH] > 0 {
                actions.push(Action::RelayCrash(r8));
            }
        }
        if let Some((h, _)) = s.lease
            && s.relays[usize::from(h)] != RelayStage::Idle
            && s.budget[LEASE_EXPIRY] > 0
        {
            actions.push(Action::LeaseExpire);
        }
        // Payments.
        if s.pay == PayStage::Idle {
            for p in 0..s.log.len() {
                if usize::from(s.position[p]) < s.log[p].len() {
                    actions.push(Action::Apply(u(p)));
                }
            }
            if s.committed != s.position {
                actions.push(Action::CommitOffsets);
            }
            for p in 0..s.log.len() {
                if s.position[p] > s.log_start[p] && s.budget[REDELIVERY] > 0 {
                    actions.push(Action::Redeliver(u(p)));
                }
            }
        } else {
            actions.push(Action::Finish);
        }
        if (s.pay != PayStage::Idle || s.committed != s.position) && s.budget[PAYMENTS_CRASH] > 0 {
            actions.push(Action::PaymentsCrash);
        }
        // Expiry.
        for p in 0..s.log.len() {
            if s.log_start[p] < s.committed[p].min(s.position[p]) {
                actions.push(Action::LogRetention(u(p)));
            }
        }
        if cfg.expiry {
            for &m in &s.inbox {
                if self.beyond_horizon(s, m) {
                    actions.push(Action::InboxExpire(m));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let cfg = self.cfg();
        let mut s = last.clone();
        match action {
            Action::Send(k) => {
                s.clients[usize::from(k)].phase = Phase::Waiting;
                s.push_req(Req {
                    key: k,
                    stage: Stage::Received,
                });
            }
            Action::Retry(k) => {
                let c = &mut s.clients[usize::from(k)];
                c.retries_left -= 1;
                c.phase = Phase::Waiting;
                s.push_req(Req {
                    key: k,
                    stage: Stage::Received,
                });
            }
            Action::Commit(i) => self.commit(&mut s, usize::from(i)),
            Action::SecondWrite(i) => self.second_write(&mut s, usize::from(i)),
            Action::Answer(i) => {
                let r = s.reqs.remove(usize::from(i));
                if let Stage::Committed { order } = r.stage {
                    s.answer(r.key, order);
                }
            }
            Action::OrdersCrash => {
                s.budget[ORDERS_CRASH] -= 1;
                s.reqs.clear();
                for c in &mut s.clients {
                    if c.phase == Phase::Waiting {
                        c.phase = Phase::Failed;
                    }
                }
            }
            Action::Cancel(k) => {
                let Phase::Acked(order) = s.clients[usize::from(k)].phase else {
                    return None;
                };
                s.clients[usize::from(k)].cancelled = true;
                let msg = s.new_msg(order, Kind::Cancelled);
                s.outbox.push(Row {
                    msg,
                    published: false,
                });
            }
            Action::Acquire(r) => {
                s.epoch += 1;
                s.lease = Some((r, s.epoch));
            }
            Action::Claim(r) => {
                let row = s.claimable()?;
                s.relays[usize::from(r)] = RelayStage::Claimed {
                    row,
                    epoch: s.epoch,
                };
            }
            Action::Publish(r) => {
                let RelayStage::Claimed { row, epoch } = s.relays[usize::from(r)] else {
                    return None;
                };
                if cfg.fence == Fence::Publish && s.lease != Some((r, epoch)) {
                    s.relays[usize::from(r)] = RelayStage::Idle;
                } else {
                    let msg = s.outbox[usize::from(row)].msg;
                    let p = s.partition(cfg, msg);
                    s.log[p].push(msg);
                    s.relays[usize::from(r)] = RelayStage::Published { row, epoch };
                }
            }
            Action::Mark(r) => {
                let RelayStage::Published { row, epoch } = s.relays[usize::from(r)] else {
                    return None;
                };
                // Both fences refuse a stale mark: the session's end aborted
                // the claim's transaction.
                if s.lease == Some((r, epoch)) {
                    s.outbox[usize::from(row)].published = true;
                }
                s.relays[usize::from(r)] = RelayStage::Idle;
            }
            Action::RelayCrash(r) => {
                s.budget[RELAY_CRASH] -= 1;
                s.relays[usize::from(r)] = RelayStage::Idle;
                if s.lease.is_some_and(|(h, _)| h == r) {
                    s.lease = None;
                }
            }
            Action::LeaseExpire => {
                s.budget[LEASE_EXPIRY] -= 1;
                s.lease = None;
            }
            Action::Apply(p) => self.apply(&mut s, usize::from(p)),
            Action::Finish => self.finish(&mut s),
            Action::CommitOffsets => s.committed.clone_from(&s.position),
            Action::PaymentsCrash => {
                s.budget[PAYMENTS_CRASH] -= 1;
                s.pay = PayStage::Idle;
                s.position.clone_from(&s.committed);
            }
            Action::Redeliver(p) => {
                s.budget[REDELIVERY] -= 1;
                let p = usize::from(p);
                s.position[p] = s.log_start[p];
            }
            Action::LogRetention(p) => s.log_start[usize::from(p)] += 1,
            Action::InboxExpire(m) => s.inbox.retain(|&x| x != m),
            Action::KeyExpire(k) => s.keys[usize::from(k)] = None,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        crate::properties::properties()
    }
}
