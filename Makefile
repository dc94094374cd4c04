# effectively-once: the commands people run. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo

# Connection settings written by `make up` (DATABASE_URL, the owner's, and
# each service's own ORDERS_DATABASE_URL, RELAY_DATABASE_URL, ...), in the
# stack's directory (STACK_DIR, as scripts/stack.sh takes it).
STACK_DIR ?= $(CURDIR)/.stack
export STACK_DIR
-include $(STACK_DIR)/env

.PHONY: help up down status clean kafka migrate build test fuzz fmt lint sqlx-prepare orders bench-orders bench-pipeline bench-security bench-cdc bench-library bench-library-relay bench-relay-ab bench-inbox bench-recon bench-relay-sweep bench-claim wal-slot-lost wal-witness pg-ha-check key-expiry demo demo-webhooks demo-debezium debezium \
        check-config check-compose check-dashboards docs plot-deps plot-orders chaos model exp-1 exp-2 exp-3 exp-4 exp-5 exp-6 exp-7 exp-8 exp-9 exp-10 exp-10-long exp-11 accept

help: ## list the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-17s %s\n", $$1, $$2}'

up: ## start the embedded stack (PostgreSQL and a 3-node Apache Kafka on 127.0.0.1), apply migrations, print .stack/env
	@scripts/stack.sh up
	@$(MAKE) --no-print-directory migrate

down: ## stop the embedded stack (data stays in .stack/ until you delete it)
	@scripts/stack.sh down

status: ## say what the embedded stack runs
	@scripts/stack.sh status

clean: ## drop what tests and benchmarks left on the stack: test_* databases, test-* and bench.* topics
	@scripts/stack.sh clean

kafka: ## Kafka's own CLIs against the stack: make kafka ARGS="topics --describe --topic order.events" (scripts/kafka.sh --help)
	@scripts/kafka.sh $(ARGS)

migrate: ## apply the migrations to $DATABASE_URL, as the owner (creates the services' roles, grants them)
	@. $(STACK_DIR)/env && $(CARGO) run -q --release -p orders -- --migrate-only

build: ## build every binary (release)
	$(CARGO) build --release --workspace

fmt: ## format the code
	$(CARGO) fmt --all

lint: ## fmt check + clippy -D warnings + the library's (with all its features and with none) and the pipeline crate's docs without a warning
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc -q -p effectively -p pipeline --no-deps --all-features
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc -q -p effectively --no-deps --no-default-features

test: ## the test command (installs cargo-nextest and sqlx-cli when missing, starts the stack): lint, the compile-time SQL data fresh (.sqlx), the experiments' verdict tests and the benchmarks' helpers' tests, every test against the real stack (starts it), then three short demos (over Kafka, over webhooks, and with Debezium as the relay, its worker killed -9 mid-load) that fail on drift
	@scripts/tools.sh cargo-tools
	@scripts/stack.sh up >/dev/null
	$(MAKE) --no-print-directory lint
	scripts/check-sqlx.sh
	python3 -m unittest discover -s experiments/lib
	python3 -m unittest discover -s scripts/lib
	@# The env file `up` just wrote (make read it before the stack was up):
	@# the tests' connections take the passwords and the CA from it (PGPASSFILE, ...).
	. $(STACK_DIR)/env && $(CARGO) nextest run --workspace --no-fail-fast
	. $(STACK_DIR)/env && $(CARGO) test -q --doc -p effectively --all-features
	@# The library as it would be published: from its packaged sources alone,
	@# with its default features (no pipeline crate, no database at build time).
	$(CARGO) package -q -p effectively --allow-dirty
	@# Each test made a topic (test-<uuid>) and a database (test_<uuid>); left
	@# there, a thousand-odd topics make a broker killed -9 (experiment 8) recover
	@# for a minute before it serves, and every message cost the brokers more.
	scripts/stack.sh clean
	DEMO_PROFILE=debug DEMO_SECONDS=5 DEMO_RATE=200 scripts/demo.sh
	DEMO_PROFILE=debug DEMO_SECONDS=5 DEMO_RATE=200 DEMO_TRANSPORT=http scripts/demo.sh
	DEMO_PROFILE=debug DEMO_SECONDS=10 DEMO_RATE=200 DEMO_RELAY=debezium scripts/demo.sh

sqlx-prepare: ## after changing a query: rewrite .sqlx/ (the compile-time SQL check's offline data) from a scratch database on the stack
	@scripts/check-sqlx.sh write

docs: ## the book (docs/book, mdBook) and the library's rustdoc beside it, into docs/book/book/html; fails on a broken link (installs mdbook and mdbook-linkcheck2 when missing)
	@scripts/docs.sh

fuzz: ## the property tests at fuzzing scale: 1M decoder batches, 1M router requests, 20k dead-letter batches (see FINDINGS.md)
	@scripts/fuzz.sh

model: ## model-check the protocol at the full bounds (crates/model, no stack needed): states, time, and each broken variant's shortest counter-example (see FINDINGS.md)
	$(CARGO) run -q --release -p model -- $(ARGS)

demo: ## the whole pipeline on the embedded stack with load and retries, then recon's proof
	@scripts/demo.sh

demo-webhooks: ## the same pipeline with its last hop over signed webhooks (relay --sink http, payments --source http), then recon's proof
	@DEMO_TRANSPORT=http scripts/demo.sh

demo-debezium: ## the same pipeline with Debezium's connector and Outbox Event Router as the relay (payments --input-format outbox-router), the Connect worker killed -9 mid-load, then recon's proof
	@DEMO_RELAY=debezium scripts/demo.sh

debezium: ## start Debezium beside the stack: a Kafka Connect worker with the PostgreSQL connector and the Outbox Event Router on orders.outbox (scripts/debezium.sh; status, kill, down, reset)
	@scripts/debezium.sh up

orders: ## run the orders service on the stack as its own role (HTTP :8080, gRPC :50051)
	@. $(STACK_DIR)/env && DATABASE_URL=$$ORDERS_DATABASE_URL $(CARGO) run --release -p orders

bench-orders: ## benchmark POST /orders against the pgbench ceiling (see FINDINGS.md)
	@scripts/bench-orders.sh

bench-pipeline: ## relay drain and consumer throughput vs raw rdkafka, commit→effect latency (see FINDINGS.md)
	@scripts/bench-pipeline.sh

bench-cdc: ## the poll relay, the WAL relay and Debezium on the same backlog and steady rates: highest sustained rate, commit→consume p50/p99/max, CPU per 1,000 events, memory, slot lag (BENCH_CDC_RATES, BENCH_CDC_SECONDS, BENCH_CDC_ROWS, BENCH_CDC_RELAYS; QUICK=1; see FINDINGS.md)
	@QUICK=$(QUICK) scripts/bench-cdc.sh

bench-security: ## what TLS and SASL cost: bench-pipeline on the secured stack and in plaintext, side by side, the modes alternating (BENCH_SECURITY_ROUNDS; see FINDINGS.md)
	@scripts/bench-security.sh

bench-library: ## the library's consumer loop, records/s by batch size (BENCH_LIBRARY_RECORDS, BENCH_LIBRARY_BATCHES; see FINDINGS.md)
	@scripts/stack.sh up >/dev/null
	$(CARGO) run -q --release -p effectively --features kafka --example consume_rate -- $(or $(BENCH_LIBRARY_RECORDS),20000) $(or $(BENCH_LIBRARY_BATCHES),1 16 256)

bench-library-relay: ## the library's relay, a 20,000-row backlog drained into Kafka, rows/s over 20000 keys, 1000 and 10 (BENCH_LIBRARY_ROWS, BENCH_LIBRARY_KEYS; the relay's BENCH_RELAY_BATCH, BENCH_RELAY_GROUPS, BENCH_RELAY_KEEP_PUBLISHED_S; see FINDINGS.md)
	@scripts/stack.sh up >/dev/null
	$(CARGO) run -q --release -p effectively --features kafka --example relay_rate -- $(or $(BENCH_LIBRARY_ROWS),20000) $(or $(BENCH_LIBRARY_KEYS),20000 1000 10)

bench-relay-ab: ## the relay binary's engine beside the library's, the same backlog drained into Kafka, rows/s over 20000 keys, 1000 and 10 (BENCH_AB_ROWS, BENCH_AB_KEYS, BENCH_AB_BINARY_BATCH; see FINDINGS.md)
	@scripts/stack.sh up >/dev/null
	$(CARGO) run -q --release -p relay --example relay_ab -- $(or $(BENCH_AB_ROWS),20000) $(or $(BENCH_AB_KEYS),20000 1000 10)

bench-inbox: ## payments' consume transaction on the partitioned inbox at 0 and 1M keys, msgs/s; beside another build with BENCH_BASE_BIN (BENCH_INBOX_ROUNDS, BENCH_INBOX_CHECKPOINTS; see FINDINGS.md)
	@scripts/bench-inbox.sh

bench-recon: ## recon's time on 1M and 10M consistent orders (BENCH_RECON_SIZES; see FINDINGS.md)
	@scripts/bench-recon.sh

bench-relay-sweep: ## relay drain rate by workers and batch size (after bench-pipeline)
	@scripts/bench-relay-sweep.sh

pg-ha-check: ## the HA database (STACK_PG=ha: 3 PostgreSQL nodes under Patroni, HAProxy in front) on a stack of its own, a switchover and a kill -9 failover under writes: no acknowledged write lost (PG_HA_SYNC=off: asynchronous)
	@scripts/pg-ha-check.sh

wal-slot-lost: ## the WAL relay's slot invalidated (max_slot_wal_keep_size lowered for a minute): its error, then its way out loses nothing
	@scripts/wal-slot-lost.sh

wal-witness: ## a test_decoding slot witnesses the WAL relay's: every committed outbox transaction read, none skipped
	@scripts/wal-witness.sh

bench-claim: ## the relay's claim over a 30k/300k backlog with statistics of an empty outbox, before and after its plan fix
	@scripts/bench-claim.sh

# Experiments: `make exp-N` runs experiments/exp-N-*/run.sh (full mode);
# `make exp-N QUICK=1` is the short CI mode. Results: experiments/exp-N-*/results/.
QUICK ?= 0
exp-1: ## retry storm (15% retries, Zipf hot keys): orders == keys, zero replay mismatches; p99 vs --no-idempotency
	@QUICK=$(QUICK) experiments/exp-1-retry-storm/run.sh

exp-2: ## duplicates at 5% and 30%: zero doubles, inbox hit ratio, consumer throughput by dup rate
	@QUICK=$(QUICK) experiments/exp-2-duplicates/run.sh

exp-3: ## kill -9 the relay between publish and mark, many times under load: nothing lost, duplicates absorbed
	@QUICK=$(QUICK) experiments/exp-3-relay-kill/run.sh

exp-4: ## kill -9 payments at effect and claim (clean), then the split-transaction counter-example (drift)
	@QUICK=$(QUICK) experiments/exp-4-payments-kill/run.sh

exp-5: ## the inbox at scale: single table vs msg_id partitions, growth to 100M keys, DELETE vs DROP expiry
	@QUICK=$(QUICK) experiments/exp-5-dedup-store/run.sh

exp-6: ## outbox lag under steady load and 2x/3x bursts, per relay workers x batch size: backlog, oldest row, commit→publish, CPU
	@QUICK=$(QUICK) experiments/exp-6-outbox-lag/run.sh

exp-7: ## hot keys: half the intents on 10 keys; ON CONFLICT vs advisory-lock claims, with and without coalescing
	@QUICK=$(QUICK) experiments/exp-7-hot-keys/run.sh

key-expiry: ## idempotency keys expiring under load (1,000 orders/s, 5 min, key retention 1 min): recon's key counts 0 in every snapshot, CLEAN at the end
	@QUICK=$(QUICK) experiments/key-expiry/run.sh

accept: ## the acceptance run: 20 min at 5,000 req/s, orders == keys (recon, SQL attached), p99 < 25 ms, per-minute CSV
	@QUICK=$(QUICK) experiments/accept/run.sh

exp-8: ## infrastructure faults under load (PostgreSQL crash, a Kafka node killed -9, two killed, one paused, relay hung, offsets reset), mixed with kill -9 and duplicates
	@QUICK=$(QUICK) experiments/exp-8-infra-faults/run.sh

exp-9: ## the pipeline over webhooks: receiver down, 500s, slower than the timeout, killed; the retry schedule observed; failed deliveries replayed
	@QUICK=$(QUICK) experiments/exp-9-webhooks/run.sh

exp-10: ## scale-out: every service as several instances, the payments group scaled 6 -> 1 -> 6 -> 2 -> 6 under load, kill -9 of any instance
	@QUICK=$(QUICK) experiments/exp-10-scale-out/run.sh

exp-10-long: ## experiment 10's long run: an hour of every crash point, kill -9 from outside, every infrastructure and network fault, duplicates; no shard or partition stalled
	@QUICK=$(QUICK) experiments/exp-10-scale-out/long.sh

exp-11: ## the database fails over: the pipeline under load on the PostgreSQL cluster (STACK_PG=ha) through a failover, a switchover, the synchronous standby lost, the primary crashed in place
	@QUICK=$(QUICK) experiments/exp-11-failover/run.sh

chaos: ## chaos --help: the pipeline under load, duplicates and kill -9, then recon
	@$(CARGO) run -q --release -p chaos -- --help

check-config: ## validate docker-compose.yml (Compose Spec schema) and the Prometheus configs (promtool), no Docker
	@scripts/check-config.sh

check-compose: ## compose's security without Docker: its own scripts and settings in network namespaces (TLS, SCRAM, ACLs, refusals, the pipeline to recon CLEAN)
	@cargo build -q -p orders -p relay -p payments -p recon -p loadgen -p pipeline
	@scripts/check-compose.sh

check-dashboards: ## check-config, then a short real run scraped by Prometheus: every Grafana panel query must return data
	@scripts/check-dashboards.sh

plot-deps: ## install matplotlib (and jsonschema, PyYAML for check-config) into the project venv .tools/venv
	@scripts/tools.sh venv >/dev/null

# The newest bench-orders run unless ORDERS_SUMMARY=path/to/summary.json is given.
ORDERS_SUMMARY ?= $(lastword $(sort $(wildcard bench/results/orders-*/summary.json)))
plot-orders: plot-deps ## latency.png + throughput.png of the newest bench-orders run (or ORDERS_SUMMARY=…)
	@test -n "$(ORDERS_SUMMARY)" || { echo "no bench/results/orders-*/summary.json; run make bench-orders" >&2; exit 1; }
	@.tools/venv/bin/python scripts/plot.py orders $(ORDERS_SUMMARY)
