//! What the statements count, and the report they add up to: the counts
//! of each order-id range ([`Part`]), the stored responses compared in Rust
//! ([`Responses`]), the stores' floors ([`Floors`]), the dead letters, and
//! the [`Report`] with its deltas, its verdict under a [`Policy`] and its
//! table.

use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::sql::RESPONSES_SQL;

/// The counts of one order-id range ([`PART_SQL`](crate::PART_SQL)); every field adds up
/// across the ranges of a partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Part {
    /// Orders.
    pub orders: i64,
    /// Sum of their amounts.
    pub order_amount: i64,
    /// Keys that point at an order of the range.
    pub keys_matched: i64,
    /// Orders minted at or above the keys' floor (their keys are kept).
    pub orders_since_key_floor: i64,
    /// Orders minted at or above the outbox's floor (their events are kept).
    pub orders_since_outbox_floor: i64,
    /// Orders no key points at (of those since the keys' floor).
    pub orders_without_key: i64,
    /// Orders two or more keys point at.
    pub orders_with_many_keys: i64,
    /// Outbox events of an order of the range.
    pub events_matched: i64,
    /// Orders with no outbox event (of those since the outbox's floor).
    pub orders_without_event: i64,
    /// Orders with more than one outbox event.
    pub orders_with_many_events: i64,
    /// Orders with an event whose payload is not the order.
    pub event_payload_mismatches: i64,
    /// Charges of an order of the range.
    pub charges_matched: i64,
    /// Orders with no charge.
    pub orders_without_charge: i64,
    /// Charges whose account or amount differs from their order's.
    pub charge_mismatches: i64,
    /// Charges made by no outbox event of their order.
    pub charges_by_another_event: i64,
    /// Ledger entries of an order of the range.
    pub effects_matched: i64,
    /// Orders with more than one ledger entry.
    pub double_charges: i64,
    /// Charges with no ledger entry.
    pub charges_without_effect: i64,
    /// Orders with a ledger entry that differs from the charge.
    pub effect_mismatches: i64,
    /// Keys in the range.
    pub keys: i64,
    /// ... of an order minted at or above the keys' floor.
    pub keys_since_floor: i64,
    /// ... whose stored response names another order.
    pub foreign_responses: i64,
    /// Outbox events in the range.
    pub events: i64,
    /// ... not marked published.
    pub unpublished: i64,
    /// ... marked failed.
    pub failed: i64,
    /// ... of an order minted at or above the outbox's floor.
    pub events_since_outbox_floor: i64,
    /// Outbox events in the range (of msg_ids) at or above the msg_id floor.
    pub events_since_msg_floor: i64,
    /// Charges in the range.
    pub charges: i64,
    /// Sum of their amounts.
    pub charge_amount: i64,
    /// Ledger entries in the range.
    pub effects: i64,
    /// Sum of their amounts.
    pub effect_amount: i64,
    /// Inbox msg_ids in the range (of msg_ids) at or above the msg_id floor.
    pub inbox: i64,
    /// Outbox events in the range (of msg_ids) at or above the msg_id floor
    /// whose msg_id is in the inbox.
    pub consumed: i64,
}

/// The stored responses of one order-id range ([`RESPONSES_SQL`]) against
/// the response orders stores for each key's order; every field adds up
/// across the ranges of a partition.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Responses {
    /// Keys whose stored status is not the created order's (201).
    pub wrong_status: i64,
    /// Keys whose stored `Location` is not `/orders/{the key's order id}`
    /// (another order's, or none, or more than one).
    pub wrong_location: i64,
    /// Keys whose stored `ETag` is not the one orders computes for the
    /// key's order (or none, or more than one).
    pub wrong_etag: i64,
}

impl Responses {
    fn add(self, o: &Responses) -> Responses {
        Responses {
            wrong_status: self.wrong_status + o.wrong_status,
            wrong_location: self.wrong_location + o.wrong_location,
            wrong_etag: self.wrong_etag + o.wrong_etag,
        }
    }

    /// Counts one key's stored response against orders' for `order_id`.
    fn check(&mut self, order_id: Uuid, status: i32, location: Option<&str>, etag: Option<&str>) {
        let expected = pipeline::contract::created_response(order_id);
        self.wrong_status += i64::from(status != i32::from(expected.status));
        self.wrong_location += i64::from(location != expected.header("location"));
        self.wrong_etag += i64::from(etag != expected.header("etag"));
    }

    /// Reads the stored responses of the order ids `lo` to `hi` on `conn`
    /// ([`RESPONSES_SQL`]) and checks each.
    pub async fn read(conn: &mut PgConnection, lo: Uuid, hi: Uuid) -> sqlx::Result<Self> {
        use futures::TryStreamExt;
        let mut counts = Responses::default();
        // Unchecked at compile time (see RESPONSES_SQL): the tests run it.
        let mut rows =
            sqlx::query_as::<_, (Uuid, i32, Option<String>, Option<String>)>(RESPONSES_SQL)
                .bind(lo)
                .bind(hi)
                .fetch(conn);
        while let Some((order_id, status, location, etag)) = rows.try_next().await? {
            counts.check(order_id, status, location.as_deref(), etag.as_deref());
        }
        Ok(counts)
    }
}

impl Part {
    fn add(mut self, o: &Part) -> Part {
        self.orders += o.orders;
        self.order_amount += o.order_amount;
        self.keys_matched += o.keys_matched;
        self.orders_since_key_floor += o.orders_since_key_floor;
        self.orders_since_outbox_floor += o.orders_since_outbox_floor;
        self.events_since_outbox_floor += o.events_since_outbox_floor;
        self.events_since_msg_floor += o.events_since_msg_floor;
        self.orders_without_key += o.orders_without_key;
        self.orders_with_many_keys += o.orders_with_many_keys;
        self.events_matched += o.events_matched;
        self.orders_without_event += o.orders_without_event;
        self.orders_with_many_events += o.orders_with_many_events;
        self.event_payload_mismatches += o.event_payload_mismatches;
        self.charges_matched += o.charges_matched;
        self.orders_without_charge += o.orders_without_charge;
        self.charge_mismatches += o.charge_mismatches;
        self.charges_by_another_event += o.charges_by_another_event;
        self.effects_matched += o.effects_matched;
        self.double_charges += o.double_charges;
        self.charges_without_effect += o.charges_without_effect;
        self.effect_mismatches += o.effect_mismatches;
        self.keys += o.keys;
        self.keys_since_floor += o.keys_since_floor;
        self.foreign_responses += o.foreign_responses;
        self.events += o.events;
        self.unpublished += o.unpublished;
        self.failed += o.failed;
        self.charges += o.charges;
        self.charge_amount += o.charge_amount;
        self.effects += o.effects;
        self.effect_amount += o.effect_amount;
        self.inbox += o.inbox;
        self.consumed += o.consumed;
        self
    }
}

/// Where each store that expires starts: rows below a floor may be gone by
/// design (keys after the key retention, published outbox rows after the
/// outbox retention, inbox partitions after the inbox retention); orders,
/// charges and the ledger never expire. Each floor is a UUIDv7 bound: the
/// rows minted before its time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Floors {
    /// Keys of orders minted below it may have expired.
    pub keys: Uuid,
    /// Published outbox rows minted below it may have expired.
    pub outbox: Uuid,
    /// The inbox's oldest partition starts here.
    pub inbox: Uuid,
}

impl Floors {
    /// Nothing expired: every floor at the bottom of the id space.
    pub const NONE: Floors = Floors {
        keys: Uuid::nil(),
        outbox: Uuid::nil(),
        inbox: Uuid::nil(),
    };

    /// The floor of the outbox <-> inbox match: above it, every event must be
    /// in the inbox and every inbox msg_id must be an event.
    pub fn msg(&self) -> Uuid {
        self.outbox.max(self.inbox)
    }

    /// Reads the floors (`src/sql/floors.sql`) on `conn`, in its snapshot.
    pub async fn read(conn: &mut PgConnection) -> sqlx::Result<Floors> {
        let row = sqlx::query_file!("src/sql/floors.sql")
            .fetch_one(conn)
            .await?;
        Ok(Floors {
            keys: row.keys,
            outbox: row.outbox,
            inbox: row.inbox,
        })
    }

    /// The time a UUIDv7 floor stands for, `None` for the nil floor (the
    /// whole history).
    pub fn time(floor: Uuid) -> Option<chrono::DateTime<chrono::Utc>> {
        (!floor.is_nil()).then(|| effectively::v7::mint_time(floor))
    }

    fn describe(floor: Uuid) -> String {
        Self::time(floor).map_or_else(|| "all".to_owned(), |t| format!("since {}", t.to_rfc3339()))
    }
}

/// Every count of the diff.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// What the retained stores cover (see [`Floors`]).
    pub floors: Floors,
    /// Orders minted since the keys' floor: each must have its key.
    pub orders_since_key_floor: i64,
    /// Orders minted since the outbox's floor: each must have its event.
    pub orders_since_outbox_floor: i64,
    /// Outbox rows of those orders.
    pub outbox_rows_since_floor: i64,
    /// Outbox rows minted since the msg_id floor: each must be in the inbox.
    pub events_since_msg_floor: i64,
    /// Accepted intents: idempotency keys of orders minted since the keys'
    /// floor (the keys below it may be gone by design; a key that outlives
    /// the floor's move is not counted, as its order is not).
    pub intents: i64,
    /// Orders.
    pub distinct_orders: i64,
    /// Keys whose order is missing.
    pub intents_without_order: i64,
    /// Orders no key points at.
    pub orders_without_key: i64,
    /// Orders two or more keys point at.
    pub orders_with_many_keys: i64,
    /// Keys whose stored response names another order than the key's.
    pub responses_naming_another_order: i64,
    /// Keys whose stored status is not the created order's (201): a retry
    /// would be told something else than the first request was.
    pub responses_with_wrong_status: i64,
    /// Keys whose stored `Location` is not `/orders/{the key's order id}`.
    pub responses_with_wrong_location: i64,
    /// Keys whose stored `ETag` is not the one orders computes for the
    /// key's order.
    pub responses_with_wrong_etag: i64,
    /// Outbox rows.
    pub outbox_rows: i64,
    /// Outbox rows marked published.
    pub published_rows: i64,
    /// Outbox rows still pending (failed rows included).
    pub pending_rows: i64,
    /// Outbox rows the relay marked failed (never publishable).
    pub failed_rows: i64,
    /// Orders with no outbox event.
    pub orders_without_event: i64,
    /// Outbox events (rows) for no order.
    pub events_without_order: i64,
    /// Orders with more than one outbox event.
    pub orders_with_many_events: i64,
    /// Orders whose published event's payload is not that order (id,
    /// account, amount).
    pub event_payload_mismatches: i64,
    /// msg_ids in the inbox (since the msg_id floor).
    pub inbox_msg_ids: i64,
    /// Outbox events whose msg_id is not in the inbox.
    pub events_not_consumed: i64,
    /// Inbox msg_ids of no outbox event.
    pub inbox_without_event: i64,
    /// Orders with a charge.
    pub distinct_charges: i64,
    /// Orders with no charge.
    pub orders_without_charge: i64,
    /// Charges (rows) with no order.
    pub charges_without_order: i64,
    /// Charges whose account or amount differs from their order's.
    pub charge_mismatches: i64,
    /// Charges whose msg_id is not their order's outbox event's.
    pub charges_by_another_event: i64,
    /// Effects applied (ledger entries).
    pub charge_effects: i64,
    /// Orders with more than one effect.
    pub double_charges: i64,
    /// Charges with no ledger entry.
    pub charges_without_effect: i64,
    /// Effects (ledger entries) with no order.
    pub effects_without_order: i64,
    /// Orders whose ledger entry differs from the order (account, amount) or
    /// from the charge (msg_id).
    pub effect_mismatches: i64,
    /// Dead-lettered messages.
    pub dead_letters: i64,
    /// Of those, the late duplicates: refused after the dedup horizon, and
    /// their msg_id is the one that charged the order they name.
    pub late_duplicates: i64,
    /// Webhook deliveries the sender gave up (`relay --sink http`).
    pub failed_deliveries: i64,
    /// Webhook deliveries neither delivered nor failed.
    pub open_deliveries: i64,
    /// Webhooks the receiver claimed and has not applied yet.
    pub unprocessed_webhooks: i64,
    /// Kafka events payments parked and has not applied yet.
    pub parked_events: i64,
    /// Sum of order amounts.
    pub order_amount_cents: i64,
    /// Sum of charge amounts.
    pub charge_amount_cents: i64,
    /// Sum of effect amounts.
    pub effect_amount_cents: i64,
}

/// The dead letters, counted as recon judges them (`sql/dead_letters.sql`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeadLetters {
    /// All of them.
    pub dead_letters: i64,
    /// Refused after the dedup horizon, and their msg_id is the one that
    /// charged the order they name: redeliveries of an applied effect.
    pub late_duplicates: i64,
    /// The webhook hop: deliveries the sender gave up.
    pub failed_deliveries: i64,
    /// The webhook hop: deliveries neither delivered nor failed.
    pub open_deliveries: i64,
    /// The webhook hop: claimed by the receiver, not applied yet.
    pub unprocessed_webhooks: i64,
    /// Kafka events payments parked (the inbox could not record them yet),
    /// not applied yet.
    pub parked_events: i64,
}

impl DeadLetters {
    /// Counts them on `conn`.
    pub async fn read(conn: &mut PgConnection) -> sqlx::Result<Self> {
        sqlx::query_file_as!(DeadLetters, "src/sql/dead_letters.sql")
            .fetch_one(conn)
            .await
    }
}

/// One named difference that must be zero.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delta {
    /// What is compared.
    pub name: &'static str,
    /// Its value; 0 is clean.
    pub value: i64,
}

/// What counts as drift beyond the invariant itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    /// Failed outbox rows and dead letters are reported but are not drift
    /// (`--allow-dead-letters`): for runs that inject bad input on purpose.
    pub allow_dead_letters: bool,
    /// The relay does not mark the outbox rows it publishes (Debezium's
    /// connector, `--unmarked-outbox`): pending rows are not drift (every
    /// row stays pending), and an event not consumed still is.
    pub unmarked_outbox: bool,
}

impl Report {
    /// The whole from the parts of a partition of the id space (the diff's
    /// and the stored responses'), and the dead letters.
    pub fn from_parts(
        parts: &[Part],
        responses: &[Responses],
        dead: DeadLetters,
        floors: Floors,
    ) -> Report {
        let p = parts.iter().fold(Part::default(), Part::add);
        let r = responses.iter().fold(Responses::default(), Responses::add);
        Report {
            floors,
            orders_since_key_floor: p.orders_since_key_floor,
            orders_since_outbox_floor: p.orders_since_outbox_floor,
            outbox_rows_since_floor: p.events_since_outbox_floor,
            events_since_msg_floor: p.events_since_msg_floor,
            intents: p.keys_since_floor,
            distinct_orders: p.orders,
            intents_without_order: p.keys - p.keys_matched,
            orders_without_key: p.orders_without_key,
            orders_with_many_keys: p.orders_with_many_keys,
            responses_naming_another_order: p.foreign_responses,
            responses_with_wrong_status: r.wrong_status,
            responses_with_wrong_location: r.wrong_location,
            responses_with_wrong_etag: r.wrong_etag,
            outbox_rows: p.events,
            published_rows: p.events - p.unpublished,
            pending_rows: p.unpublished,
            failed_rows: p.failed,
            orders_without_event: p.orders_without_event,
            events_without_order: p.events - p.events_matched,
            orders_with_many_events: p.orders_with_many_events,
            event_payload_mismatches: p.event_payload_mismatches,
            inbox_msg_ids: p.inbox,
            events_not_consumed: p.events_since_msg_floor - p.consumed,
            inbox_without_event: p.inbox - p.consumed,
            distinct_charges: p.charges,
            orders_without_charge: p.orders_without_charge,
            charges_without_order: p.charges - p.charges_matched,
            charge_mismatches: p.charge_mismatches,
            charges_by_another_event: p.charges_by_another_event,
            charge_effects: p.effects,
            double_charges: p.double_charges,
            charges_without_effect: p.charges_without_effect,
            effects_without_order: p.effects - p.effects_matched,
            effect_mismatches: p.effect_mismatches,
            dead_letters: dead.dead_letters,
            late_duplicates: dead.late_duplicates,
            failed_deliveries: dead.failed_deliveries,
            open_deliveries: dead.open_deliveries,
            unprocessed_webhooks: dead.unprocessed_webhooks,
            parked_events: dead.parked_events,
            order_amount_cents: p.order_amount,
            charge_amount_cents: p.charge_amount,
            effect_amount_cents: p.effect_amount,
        }
    }

    /// Every difference the invariant requires to be zero, under `policy`.
    pub fn deltas(&self, policy: Policy) -> Vec<Delta> {
        let d = |name, value| Delta { name, value };
        let mut deltas = vec![
            d(
                "distinct_orders - intents",
                self.orders_since_key_floor - self.intents,
            ),
            d("intents_without_order", self.intents_without_order),
            d("orders_without_key", self.orders_without_key),
            d("orders_with_many_keys", self.orders_with_many_keys),
            d(
                "responses_naming_another_order",
                self.responses_naming_another_order,
            ),
            d(
                "responses_with_wrong_status",
                self.responses_with_wrong_status,
            ),
            d(
                "responses_with_wrong_location",
                self.responses_with_wrong_location,
            ),
            d("responses_with_wrong_etag", self.responses_with_wrong_etag),
            d(
                "outbox_rows - distinct_orders",
                self.outbox_rows_since_floor - self.orders_since_outbox_floor,
            ),
            d("orders_without_event", self.orders_without_event),
            d("events_without_order", self.events_without_order),
            d("orders_with_many_events", self.orders_with_many_events),
            d("event_payload_mismatches", self.event_payload_mismatches),
            d(
                "pending_rows",
                if policy.unmarked_outbox {
                    0
                } else {
                    self.pending_rows - self.failed_rows
                },
            ),
            d("open_deliveries", self.open_deliveries),
            d("unprocessed_webhooks", self.unprocessed_webhooks),
            d("parked_events", self.parked_events),
            d("events_not_consumed", self.events_not_consumed),
            d("inbox_without_event", self.inbox_without_event),
            d(
                "inbox_msg_ids - outbox_rows",
                self.inbox_msg_ids - self.events_since_msg_floor,
            ),
            d(
                "distinct_charges - distinct_orders",
                self.distinct_charges - self.distinct_orders,
            ),
            d("orders_without_charge", self.orders_without_charge),
            d("charges_without_order", self.charges_without_order),
            d("charge_mismatches", self.charge_mismatches),
            d("charges_by_another_event", self.charges_by_another_event),
            d(
                "charge_effects - distinct_charges",
                self.charge_effects - self.distinct_charges,
            ),
            d("double_charges", self.double_charges),
            d("charges_without_effect", self.charges_without_effect),
            d("effects_without_order", self.effects_without_order),
            d("effect_mismatches", self.effect_mismatches),
            d(
                "charge_amount - order_amount",
                self.charge_amount_cents - self.order_amount_cents,
            ),
            d(
                "effect_amount - order_amount",
                self.effect_amount_cents - self.order_amount_cents,
            ),
        ];
        if !policy.allow_dead_letters {
            deltas.push(d("failed_rows", self.failed_rows));
            deltas.push(d("failed_deliveries", self.failed_deliveries));
            deltas.push(d(
                "dead_letters - late_duplicates",
                self.dead_letters - self.late_duplicates,
            ));
        }
        deltas
    }

    /// The names of the checks that failed.
    pub fn drift(&self, policy: Policy) -> Vec<&'static str> {
        self.deltas(policy)
            .into_iter()
            .filter(|d| d.value != 0)
            .map(|d| d.name)
            .collect()
    }

    /// Effects == intents, order by order, with nothing missing, doubled,
    /// orphaned or different.
    pub fn is_clean(&self, policy: Policy) -> bool {
        self.drift(policy).is_empty()
    }

    /// The human table.
    pub fn table(&self, policy: Policy) -> String {
        let rows: [(&str, i64); 39] = [
            ("intents (idempotency keys)", self.intents),
            ("distinct orders", self.distinct_orders),
            ("intents without order", self.intents_without_order),
            ("orders without key", self.orders_without_key),
            ("orders with many keys", self.orders_with_many_keys),
            (
                "responses naming another order",
                self.responses_naming_another_order,
            ),
            (
                "responses with wrong status",
                self.responses_with_wrong_status,
            ),
            (
                "responses with wrong Location",
                self.responses_with_wrong_location,
            ),
            ("responses with wrong ETag", self.responses_with_wrong_etag),
            ("outbox rows", self.outbox_rows),
            ("published rows", self.published_rows),
            ("pending rows", self.pending_rows),
            ("failed outbox rows", self.failed_rows),
            ("orders without event", self.orders_without_event),
            ("events without order", self.events_without_order),
            ("orders with many events", self.orders_with_many_events),
            ("event payload mismatches", self.event_payload_mismatches),
            ("inbox msg_ids", self.inbox_msg_ids),
            ("events not consumed", self.events_not_consumed),
            ("inbox msg_ids without event", self.inbox_without_event),
            ("distinct charges", self.distinct_charges),
            ("orders without charge", self.orders_without_charge),
            ("charges without order", self.charges_without_order),
            ("charge mismatches", self.charge_mismatches),
            ("charges by another event", self.charges_by_another_event),
            ("charge effects (ledger)", self.charge_effects),
            ("double charges", self.double_charges),
            ("charges without effect", self.charges_without_effect),
            ("effects without order", self.effects_without_order),
            ("effect mismatches", self.effect_mismatches),
            ("dead letters", self.dead_letters),
            ("late duplicates (dead letters)", self.late_duplicates),
            ("failed webhook deliveries", self.failed_deliveries),
            ("open webhook deliveries", self.open_deliveries),
            ("webhooks claimed, not applied", self.unprocessed_webhooks),
            ("events parked, not applied", self.parked_events),
            ("order amount (cents)", self.order_amount_cents),
            ("charge amount (cents)", self.charge_amount_cents),
            ("effect amount (cents)", self.effect_amount_cents),
        ];
        let mut out = String::from("recon: effects vs intents, order by order\n");
        let f = &self.floors;
        out.push_str(&format!(
            "  covers: orders, charges, ledger: all; keys: {}; events: {}; events <-> inbox: {}\n",
            Floors::describe(f.keys),
            Floors::describe(f.outbox),
            Floors::describe(f.msg()),
        ));
        for (name, value) in rows {
            out.push_str(&format!("  {name:<36} {value:>14}\n"));
        }
        out.push_str(if policy.allow_dead_letters {
            "deltas (all must be 0; failed rows and dead letters allowed):\n"
        } else {
            "deltas (all must be 0):\n"
        });
        for delta in self.deltas(policy) {
            let mark = if delta.value == 0 { "ok" } else { "DRIFT" };
            out.push_str(&format!(
                "  {:<36} {:>14}  {mark}\n",
                delta.name, delta.value
            ));
        }
        let drift = self.drift(policy);
        if drift.is_empty() {
            out.push_str("result: CLEAN — distinct effects == distinct intents\n");
        } else {
            out.push_str(&format!(
                "result: DRIFT — effects != intents ({})\n",
                drift.join(", ")
            ));
        }
        out
    }
}
