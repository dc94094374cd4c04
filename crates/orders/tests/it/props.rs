//! Property tests of the HTTP router, driven in process (tower `oneshot`, no
//! socket) over the real store on a fresh PostgreSQL database: whatever the
//! method, path, headers and body, the router never panics, never answers
//! 5xx, answers only the statuses the book documents (docs/book/src/orders.md), and every error
//! carries `{"error": {"code", "message"}}` with the code its status
//! documents. Replays are checked against a model of the keys used: a key's
//! retry gets the first order back, the same key with another request 409.
//!
//! `PROPS_ROUTER_CASES` sets the number of cases (default 1,000, for the
//! test run); `make fuzz` runs many more and prints the counts.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, StatusCode, header};
use orders::api::{CreatedBody, OrdersApi};
use orders::metrics::OrdersMetrics;
use orders::order::{CreateOrder, MAX_AMOUNT_CENTS};
use orders::store::{InjectFault, Store};
use orders::writer::{WriteQueue, WriterSettings};
use pipeline::config::DbArgs;
use pipeline::crash::{CrashArgs, Crasher};
use pipeline::testing::{TestDb, cases_from_env as cases};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;
use tower::ServiceExt;
use uuid::Uuid;

/// Small, so that bodies over the limit (413) are generated often.
const MAX_BODY_BYTES: usize = 1024;

/// Every status docs/book/src/orders.md documents for the HTTP API, 5xx aside (503 is
/// documented for overload and an unreachable database; neither can happen
/// to one sequential client of a healthy database).
const DOCUMENTED: [u16; 8] = [200, 201, 400, 404, 405, 409, 413, 415];

/// The methods a metric label may name (HTTP's own; gRPC's are paths).
const KNOWN_METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

/// The error codes a status may carry.
fn codes_for(status: u16) -> &'static [&'static str] {
    match status {
        400 => &[
            "missing_idempotency_key",
            "invalid_idempotency_key",
            "malformed_json",
            "invalid_request",
            "unreadable_body",
        ],
        404 => &["not_found"],
        405 => &["method_not_allowed"],
        408 => &["request_timeout"],
        409 => &["idempotency_key_reused"],
        413 => &["payload_too_large"],
        415 => &["unsupported_media_type"],
        _ => &[],
    }
}

// ---------------------------------------------------------------- inputs

/// Where the request goes.
#[derive(Debug, Clone)]
enum Target {
    /// A literal path (and query).
    Path(String),
    /// `/orders/{id}` of an order created earlier in the run (any, when none
    /// was created yet).
    KnownOrder(Index),
}

#[derive(Debug, Clone)]
struct Input {
    method: Method,
    target: Target,
    content_type: Option<Vec<u8>>,
    /// Zero, one or two `Idempotency-Key` headers.
    keys: Vec<Vec<u8>>,
    /// Other headers.
    extra: Vec<(HeaderName, Vec<u8>)>,
    body: Vec<u8>,
}

/// Bytes a header value may hold (`HeaderValue::from_bytes`): tab, and
/// everything from space up but DEL; obs-text (0x80..) included.
fn header_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        any::<u8>().prop_map(|b| {
            if (b < 0x20 && b != b'\t') || b == 0x7f {
                b ^ 0x40
            } else {
                b
            }
        }),
        0..=max,
    )
}

fn method() -> impl Strategy<Value = Method> {
    prop_oneof![
        6 => Just(Method::POST),
        3 => Just(Method::GET),
        1 => prop::sample::select(vec![
            Method::HEAD,
            Method::PUT,
            Method::DELETE,
            Method::PATCH,
            Method::OPTIONS,
            Method::TRACE,
            Method::CONNECT,
        ]),
        1 => "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,12}"
            .prop_filter_map("not a method token", |m| Method::from_bytes(m.as_bytes()).ok()),
    ]
}

/// A path segment: percent-encoded arbitrary bytes, or raw path characters
/// (stray `%` included).
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..40).prop_map(|bytes| {
            bytes.iter().fold(String::new(), |mut s, b| {
                if b.is_ascii_alphanumeric() || b"-._~".contains(b) {
                    s.push(char::from(*b));
                } else {
                    s.push_str(&format!("%{b:02X}"));
                }
                s
            })
        }),
        "[A-Za-z0-9._~!$&'()*+,;=:@%-]{0,40}",
        Just("%00".to_owned()),
        Just("%FF%FE".to_owned()),
        Just("..".to_owned()),
        any::<u128>().prop_map(|n| Uuid::from_u128(n).to_string()),
        any::<u128>().prop_map(|n| Uuid::from_u128(n).simple().to_string()),
        any::<u128>().prop_map(|n| format!("{{{}}}", Uuid::from_u128(n))),
        any::<u128>().prop_map(|n| format!("urn:uuid:{}", Uuid::from_u128(n))),
    ]
}

fn target() -> impl Strategy<Value = Target> {
    let query = prop::option::weighted(0.15, "[A-Za-z0-9._~!$&'()*+,;=:@%/?-]{0,30}");
    let path = prop_oneof![
        8 => Just("/orders".to_owned()),
        2 => Just("/metrics".to_owned()),
        3 => segment().prop_map(|s| format!("/orders/{s}")),
        1 => prop::sample::select(vec![
            "/", "/orders/", "/orders//", "/ORDERS", "/metrics/", "/orders/../metrics",
            "//orders", "/orders/a/b", "/metrics/x",
        ])
        .prop_map(str::to_owned),
        1 => prop::collection::vec(segment(), 0..4).prop_map(|s| format!("/{}", s.join("/"))),
    ];
    prop_oneof![
        6 => (path, query).prop_map(|(path, query)| Target::Path(match query {
            Some(q) => format!("{path}?{q}"),
            None => path,
        })),
        1 => any::<Index>().prop_map(Target::KnownOrder),
    ]
}

fn content_type() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        8 => Just(Some(b"application/json".to_vec())),
        2 => prop::sample::select(vec![
            "application/json; charset=utf-8",
            "Application/JSON",
            " application/json ;charset=latin1",
            "application/json;",
            "application/json, text/plain",
            "application/jsonx",
            "application/json-seq",
            "application/problem+json",
            "text/plain",
            "text/json",
            "multipart/form-data; boundary=x",
            "",
            ";",
        ])
        .prop_map(|s| Some(s.as_bytes().to_vec())),
        1 => Just(None),
        1 => header_bytes(40).prop_map(Some),
    ]
}

/// Idempotency keys: a small pool (so that retries and reuse with another
/// request happen), random valid ones, and invalid ones of every kind.
fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => (0u8..24).prop_map(|n| format!("pool-{n}").into_bytes()),
        2 => "[!-~]{1,255}".prop_map(String::into_bytes),
        1 => Just(vec![b'k'; 255]),
        1 => Just(vec![b'k'; 256]),
        2 => header_bytes(300),
    ]
}

fn keys() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop_oneof![
        8 => key().prop_map(|k| vec![k]),
        1 => Just(Vec::new()),
        1 => (key(), key()).prop_map(|(a, b)| vec![a, b]),
    ]
}

fn extra_headers() -> impl Strategy<Value = Vec<(HeaderName, Vec<u8>)>> {
    let name = prop_oneof![
        prop::sample::select(vec![
            header::ACCEPT,
            header::ACCEPT_ENCODING,
            header::CONTENT_ENCODING,
            header::EXPECT,
            header::IF_MATCH,
            header::IF_NONE_MATCH,
            header::ORIGIN,
            header::RANGE,
            header::USER_AGENT,
            HeaderName::from_static("x-request-id"),
        ]),
        "[a-z0-9!#$%&'*+.^_`|~-]{1,20}".prop_filter_map("not a header name", |n| {
            HeaderName::from_bytes(n.as_bytes()).ok()
        }),
    ];
    prop::collection::vec((name, header_bytes(60)), 0..3)
}

/// Number texts at and around every bound the API has, and ones serde or
/// i64 cannot hold.
fn number_text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "1",
            "-1",
            "-0",
            "42",
            "10000000000",
            "10000000001",
            "9223372036854775807",
            "9223372036854775808",
            "-9223372036854775808",
            "-9223372036854775809",
            "18446744073709551616",
            "123456789012345678901234567890123456789",
            "1e3",
            "1E400",
            "-1e400",
            "1.0",
            "1.5",
            "0.0000001",
            "01",
            "+1",
            ".5",
            "1.",
            "0x10",
            "NaN",
            "Infinity",
            "\"42\"",
            "\"\"",
            "null",
            "true",
            "[]",
            "{}",
            "[1, 2]",
            "{\"a\": 1}",
        ])
        .prop_map(str::to_owned),
        any::<i64>().prop_map(|n| n.to_string()),
        (1..=MAX_AMOUNT_CENTS).prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        "[0-9]{20,400}",
    ]
}

/// JSON-ish objects shaped like an order: the two fields with odd values,
/// duplicated, missing, misspelt, or with extra fields.
fn near_order() -> impl Strategy<Value = Vec<u8>> {
    let name = prop_oneof![
        4 => Just("account_id".to_owned()),
        4 => Just("amount_cents".to_owned()),
        1 => prop::sample::select(vec![
            "Account_Id", "account_id ", "status", "order_id", "", "account_id\\u0000",
            "amount_cents\u{0}", "__proto__",
        ])
        .prop_map(str::to_owned),
        1 => any::<String>().prop_map(|s| serde_json::to_string(&s).map(|q| q[1..q.len() - 1].to_owned()).unwrap_or_default()),
    ];
    let field = (name, number_text());
    (
        prop::collection::vec(field, 0..5),
        prop::sample::select(vec!["", " ", "\n\t", "\u{feff}"]),
        any::<bool>(),
    )
        .prop_map(|(fields, ws, array)| {
            let body = if array {
                let values: Vec<&str> = fields.iter().map(|(_, v)| v.as_str()).collect();
                format!("[{}]", values.join(","))
            } else {
                let pairs: Vec<String> = fields
                    .iter()
                    .map(|(k, v)| format!("{ws}\"{k}\"{ws}:{ws}{v}"))
                    .collect();
                format!("{ws}{{{}}}{ws}", pairs.join(","))
            };
            body.into_bytes()
        })
}

/// A valid order, small in range so that a pool key's retries often carry
/// the same request and sometimes another.
fn valid_order() -> impl Strategy<Value = Vec<u8>> {
    (
        1i64..4,
        prop_oneof![1i64..4, Just(MAX_AMOUNT_CENTS)],
        any::<bool>(),
    )
        .prop_map(|(account, amount, swap)| {
            if swap {
                format!(r#" {{ "amount_cents" : {amount} , "account_id" : {account} }} "#)
            } else {
                format!(r#"{{"account_id":{account},"amount_cents":{amount}}}"#)
            }
            .into_bytes()
        })
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        Just("account_id".to_owned()),
                        Just("amount_cents".to_owned()),
                        any::<String>()
                    ],
                    inner
                ),
                0..6
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Nesting past serde_json's recursion limit (128), closed or not.
fn deep() -> impl Strategy<Value = Vec<u8>> {
    (1usize..400, any::<bool>(), any::<bool>()).prop_map(|(depth, objects, closed)| {
        let (open, close) = if objects {
            ("{\"account_id\":", "}")
        } else {
            ("[", "]")
        };
        let mut s = open.repeat(depth);
        s.push('1');
        if closed {
            s.push_str(&close.repeat(depth));
        }
        s.into_bytes()
    })
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => valid_order(),
        4 => near_order(),
        2 => json_value().prop_map(|v| serde_json::to_vec(&v).unwrap_or_default()),
        2 => prop::collection::vec(any::<u8>(), 0..1200),
        1 => Just(Vec::new()),
        1 => deep(),
        // Over the limit, valid JSON otherwise.
        1 => (MAX_BODY_BYTES - 40..MAX_BODY_BYTES * 3).prop_map(|n| {
            format!(r#"{{"account_id":1,{}"amount_cents":1}}"#, " ".repeat(n)).into_bytes()
        }),
    ]
}

/// Mostly the routes' own methods, so that most requests get past the
/// router to the handlers; any method on any path otherwise.
fn request_line() -> impl Strategy<Value = (Method, Target)> {
    let query = || prop::option::weighted(0.1, "[A-Za-z0-9=&%-]{0,12}");
    prop_oneof![
        10 => query().prop_map(|q| (
            Method::POST,
            Target::Path(q.map_or("/orders".to_owned(), |q| format!("/orders?{q}")))
        )),
        2 => (prop::sample::select(vec![Method::GET, Method::HEAD]), segment())
            .prop_map(|(m, s)| (m, Target::Path(format!("/orders/{s}")))),
        2 => any::<Index>().prop_map(|i| (Method::GET, Target::KnownOrder(i))),
        1 => Just((Method::GET, Target::Path("/metrics".to_owned()))),
        4 => (method(), target()),
    ]
}

fn input() -> impl Strategy<Value = Input> {
    (
        request_line(),
        content_type(),
        keys(),
        extra_headers(),
        body(),
    )
        .prop_map(
            |((method, target), content_type, keys, extra, body)| Input {
                method,
                target,
                content_type,
                keys,
                extra,
                body,
            },
        )
}

// ---------------------------------------------------------------- model

/// What the run has created: key → (request, order id), and the orders
/// (in creation order, for `Target::KnownOrder`).
#[derive(Default)]
struct Model {
    keys: HashMap<Vec<u8>, (CreateOrder, Uuid)>,
    orders: HashMap<Uuid, CreateOrder>,
    order_ids: Vec<Uuid>,
    statuses: BTreeMap<u16, u64>,
    cases: u64,
}

impl Input {
    fn path(&self, model: &Model) -> String {
        match &self.target {
            Target::Path(p) => p.clone(),
            Target::KnownOrder(i) if model.order_ids.is_empty() => {
                format!("/orders/{}", Uuid::from_u128(i.index(usize::MAX) as u128))
            }
            Target::KnownOrder(i) => {
                format!(
                    "/orders/{}",
                    model.order_ids[i.index(model.order_ids.len())]
                )
            }
        }
    }

    fn request(&self, path: &str) -> Request<Body> {
        let mut request = Request::builder()
            .method(self.method.clone())
            .uri(path)
            .body(Body::from(self.body.clone()))
            .unwrap_or_else(|e| panic!("test bug: unbuildable request {path:?}: {e}"));
        let headers = request.headers_mut();
        for (name, value) in &self.extra {
            headers.append(name, value_of(value));
        }
        if let Some(ct) = &self.content_type {
            headers.insert(header::CONTENT_TYPE, value_of(ct));
        }
        for key in &self.keys {
            headers.append("idempotency-key", value_of(key));
        }
        request
    }
}

fn value_of(bytes: &[u8]) -> HeaderValue {
    HeaderValue::from_bytes(bytes)
        .unwrap_or_else(|e| panic!("test bug: {bytes:?} is no header value: {e}"))
}

/// The checks of one response.
fn check(
    input: &Input,
    path: &str,
    status: StatusCode,
    headers: &axum::http::HeaderMap,
    body: &[u8],
    model: &mut Model,
) -> Result<(), TestCaseError> {
    let code = status.as_u16();
    prop_assert!(
        !status.is_server_error(),
        "5xx: {status} {:?}",
        String::from_utf8_lossy(body)
    );
    prop_assert!(DOCUMENTED.contains(&code), "undocumented status {status}");
    let head = input.method == Method::HEAD;
    let route = path.split('?').next().unwrap_or(path);

    if status.is_client_error() {
        prop_assert_eq!(
            headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            Some("application/json"),
            "error without a JSON body"
        );
        if !head {
            let json: Value = serde_json::from_slice(body)
                .map_err(|e| TestCaseError::fail(format!("error body is not JSON: {e}")))?;
            let error_code = json["error"]["code"].as_str().unwrap_or_default();
            prop_assert!(
                codes_for(code).contains(&error_code),
                "{status} with code {error_code:?}: {json}"
            );
            prop_assert!(
                json["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "error without a message: {json}"
            );
        }
    }

    match code {
        405 => prop_assert!(headers.contains_key(header::ALLOW), "405 without Allow"),
        201 => {
            prop_assert_eq!(&input.method, &Method::POST);
            prop_assert_eq!(route, "/orders");
            let created: CreatedBody = serde_json::from_slice(body)
                .map_err(|e| TestCaseError::fail(format!("201 body: {e}")))?;
            prop_assert_eq!(created.status.as_str(), "created");
            let location = format!("/orders/{}", created.order_id);
            prop_assert_eq!(
                headers.get(header::LOCATION).and_then(|v| v.to_str().ok()),
                Some(location.as_str())
            );
            prop_assert!(headers.contains_key(header::ETAG));
            let request: CreateOrder = serde_json::from_slice(&input.body)
                .map_err(|e| TestCaseError::fail(format!("201 for an unparsable body: {e}")))?;
            prop_assert!(request.validate().is_ok(), "201 for an invalid request");
            let key = input.keys.first().cloned().unwrap_or_default();
            match model.keys.get(&key) {
                // A retry: the first response, whatever the JSON layout.
                Some(&(first, order_id)) => {
                    prop_assert_eq!(first, request, "201 for a reused key and another request");
                    prop_assert_eq!(order_id, created.order_id, "a retry got another order");
                }
                None => {
                    model.keys.insert(key, (request, created.order_id));
                    model.orders.insert(created.order_id, request);
                    model.order_ids.push(created.order_id);
                }
            }
        }
        409 => {
            let key = input.keys.first().cloned().unwrap_or_default();
            let request: CreateOrder = serde_json::from_slice(&input.body)
                .map_err(|e| TestCaseError::fail(format!("409 for an unparsable body: {e}")))?;
            match model.keys.get(&key) {
                Some((first, _)) => prop_assert_ne!(*first, request, "409 for a true retry"),
                None => prop_assert!(false, "409 for a key never used"),
            }
        }
        200 => {
            prop_assert!(matches!(input.method, Method::GET | Method::HEAD));
            // The metrics have an address of their own (`--metrics-addr`).
            prop_assert!(route != "/metrics", "the public port serves the metrics");
            if !head {
                let order: Value = serde_json::from_slice(body)
                    .map_err(|e| TestCaseError::fail(format!("200 body: {e}")))?;
                let id = order["order_id"]
                    .as_str()
                    .and_then(|s| Uuid::parse_str(s).ok());
                let known = id.and_then(|id| model.orders.get(&id));
                prop_assert!(known.is_some(), "200 for an order never created: {order}");
                if let Some(request) = known {
                    prop_assert_eq!(order["account_id"].as_i64(), Some(request.account_id));
                    prop_assert_eq!(order["amount_cents"].as_i64(), Some(request.amount_cents));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

// ---------------------------------------------------------------- harness

fn service(rt: &tokio::runtime::Runtime) -> (Router, Arc<OrdersMetrics>, TestDb) {
    rt.block_on(async {
        let db = TestDb::create().await;
        let mut args = DbArgs::for_url(&db.url);
        args.db_migrate = false; // TestDb::create migrated it
        let pool = pipeline::db::connect(&args, orders::config::SESSION_LIMITS)
            .await
            .expect("connect");
        let metrics = Arc::new(OrdersMetrics::new().expect("metrics"));
        let settings = WriterSettings {
            writers: 2,
            max_batch: 16,
            queue: 64,
            // Lingering on: concurrent requests wait for each other's batch.
            linger: std::time::Duration::from_millis(1),
        };
        let store = Arc::new(Store::new(
            pool,
            InjectFault::None,
            false,
            Crasher::new(CrashArgs::default()),
        ));
        let (writes, _writers) = WriteQueue::start(store.clone(), settings, metrics.clone());
        let router = orders::http::router(
            OrdersApi::new(store, writes, metrics.clone()),
            MAX_BODY_BYTES,
            Duration::from_secs(30),
        );
        (router, metrics, db)
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Sends one input and checks the response as the property does.
fn send(
    rt: &tokio::runtime::Runtime,
    router: &Router,
    input: &Input,
    model: &mut Model,
) -> Result<(StatusCode, Value), TestCaseError> {
    model.cases += 1;
    let path = input.path(model);
    let response = rt
        .block_on(router.clone().oneshot(input.request(&path)))
        .unwrap_or_else(|e| match e {});
    let (parts, body) = response.into_parts();
    let body = rt
        .block_on(axum::body::to_bytes(body, usize::MAX))
        .map_err(|e| TestCaseError::fail(format!("response body: {e}")))?;
    *model.statuses.entry(parts.status.as_u16()).or_default() += 1;
    check(input, &path, parts.status, &parts.headers, &body, model)?;
    Ok((
        parts.status,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    ))
}

/// The inputs the property found answered outside the contract (405 and
/// 400 with a text body), kept as plain cases.
#[test]
fn regressions_found_by_the_property() {
    let rt = runtime();
    let (router, _metrics, _db) = service(&rt);
    let mut model = Model::default();
    let get = |path: &str, method: Method| Input {
        method,
        target: Target::Path(path.to_owned()),
        content_type: None,
        keys: Vec::new(),
        extra: Vec::new(),
        body: Vec::new(),
    };
    // A method the route does not take: was an empty 405.
    for (path, method) in [
        ("/orders/x", Method::POST),
        ("/orders", Method::GET),
        ("/orders/x", Method::DELETE),
    ] {
        let (status, body) = send(&rt, &router, &get(path, method), &mut model)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(body["error"]["code"], "method_not_allowed");
    }
    // An id that percent-decodes to invalid UTF-8: was a 400 in plain text.
    for path in ["/orders/%FF%FE", "/orders/%C0", "/orders/a%80b"] {
        let (status, body) = send(&rt, &router, &get(path, Method::GET), &mut model)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(body["error"]["code"], "not_found");
    }
}

#[test]
fn router_answers_only_documented_statuses() {
    let rt = runtime();
    let (router, metrics, _db) = service(&rt);
    let cases = cases("PROPS_ROUTER_CASES", 1_000);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        // No strategy filters much, but a million cases add up.
        max_local_rejects: u32::MAX,
        max_global_rejects: u32::MAX,
        ..Config::default()
    });
    let model = RefCell::new(Model::default());
    let start = Instant::now();
    let result = runner.run(&input(), |input| {
        send(&rt, &router, &input, &mut model.borrow_mut()).map(drop)
    });
    let model = model.into_inner();
    eprintln!(
        "router property: {} cases in {:.1} s; statuses {:?}; {} orders created",
        model.cases,
        start.elapsed().as_secs_f64(),
        model.statuses,
        model.orders.len()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    // Label values come from a fixed set, never from the request: a client
    // must not be able to mint series.
    let text = pipeline::metrics::render(&metrics.registry).expect("render the metrics");
    for method in text.split("method=\"").skip(1) {
        let method = method.split('"').next().unwrap_or_default();
        assert!(
            KNOWN_METHODS.contains(&method),
            "a series labelled with the request's method {method:?}"
        );
    }
}
