# syntax=docker/dockerfile:1
# The project's binaries (orders, relay, payments, recon, loadgen, kafka-tool)
# in one image; docker-compose.yml picks the binary per service.
#   docker build -t effectively:local .
#
# Build needs: the Rust toolchain; rdkafka's bundled librdkafka (rdkafka-sys)
# is compiled with its configure script + make by a C/C++ compiler and links
# the system zlib and OpenSSL (TLS and SASL/SCRAM to the brokers; found by
# pkg-config). protox compiles proto/ in pure Rust,
# so no protoc. sqlx checks the SQL of its query macros against the committed
# offline data (.sqlx/; .cargo/config.toml sets SQLX_OFFLINE), so no database
# at build time.
FROM rust:1.95.0-bookworm AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential pkg-config zlib1g-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY .cargo .cargo
COPY .sqlx .sqlx
COPY crates crates
COPY loadgen loadgen
COPY migrations migrations
COPY proto proto
# The cache mounts keep the registry and target/ between builds; the binaries
# are copied out in the same step because the cached target/ is not in the layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
 && mkdir -p /out \
 && for bin in orders relay payments recon loadgen kafka-tool; do cp "target/release/$bin" /out/; done

FROM debian:bookworm-slim
# curl: the compose healthchecks; openssl: the compose `secrets` service makes the
# stack's CA, certificates and passwords (scripts/compose/secrets.sh); librdkafka's
# shared dependencies: zlib1g is in the base image, libssl3 named here.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl libssl3 openssl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home app
COPY --from=builder /out/ /usr/local/bin/
USER app
ENV RUST_LOG=info
CMD ["orders"]
