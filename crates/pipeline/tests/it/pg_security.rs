//! PostgreSQL trusts nobody (scripts/lib/pg-security.sh), against the
//! stack's real server: every role needs its own password, TCP without TLS
//! finds no way in, the server's certificate is verified against the
//! stack's CA and nothing else, no rule of pg_hba.conf trusts, and the
//! socket and data directories are closed to other users. What each role
//! may do once in is `roles.rs`.

use std::str::FromStr;

use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, stack_var, stack_var_opt};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{ConnectOptions, Connection, PgConnection};

/// SQLSTATE 28P01: invalid_password.
const INVALID_PASSWORD: &str = "28P01";
/// SQLSTATE 28000: invalid_authorization_specification (no pg_hba.conf line).
const NO_HBA_LINE: &str = "28000";

/// Whether the stack runs PostgreSQL with TLS only (`STACK_SECURITY=tls`,
/// its default); `plaintext` is the counter-example the cost of TLS is
/// measured against.
fn tls_only() -> bool {
    stack_var_opt("STACK_SECURITY").as_deref() != Some("plaintext")
}

/// Every role's URL on `db`, the owner's first.
fn urls(db: &TestDb) -> Vec<(String, String)> {
    let mut urls = vec![("postgres".to_owned(), db.url.clone())];
    urls.extend(
        ServiceRole::ALL
            .iter()
            .map(|role| (role.name().to_owned(), db.url_as(*role))),
    );
    urls
}

/// How the server refuses `options`: the SQLSTATE (when it answered with
/// one) and the error. Panics, naming `what`, when it lets them in.
async fn refusal(options: PgConnectOptions, what: &str) -> (Option<String>, sqlx::Error) {
    let error = options
        .connect()
        .await
        .err()
        .unwrap_or_else(|| panic!("{what}: let in"));
    let code = match &error {
        sqlx::Error::Database(e) => e.code().map(|c| c.into_owned()),
        _ => None,
    };
    (code, error)
}

#[tokio::test]
async fn every_role_signs_in_with_its_own_password_and_no_other() {
    let db = TestDb::create().await;
    for (role, url) in urls(&db) {
        let options = PgConnectOptions::from_str(&url).expect("a URL");
        // With the stack's password file: in.
        let mut conn = options.connect().await.unwrap_or_else(|e| {
            panic!("{role} must sign in with its password: {e}");
        });
        let user: String = sqlx::query_scalar("SELECT current_user::text")
            .fetch_one(&mut conn)
            .await
            .expect("current_user");
        assert_eq!(user, role);
        let _ = conn.close().await;
        for wrong in ["", "wrong", "postgres"] {
            let what = format!("{role} with the password {wrong:?}");
            let (code, error) = refusal(options.clone().password(wrong), &what).await;
            assert_eq!(code.as_deref(), Some(INVALID_PASSWORD), "{what}: {error}");
        }
        // Another role's password is not this one's.
        let other = if role == "effectively_recon" {
            "effectively_orders"
        } else {
            "effectively_recon"
        };
        let what = format!("{role} with {other}'s password");
        let (code, error) = refusal(options.clone().password(&password_of(other)), &what).await;
        assert_eq!(code.as_deref(), Some(INVALID_PASSWORD), "{what}: {error}");
    }
}

/// `role`'s password, from the stack's password file.
fn password_of(role: &str) -> String {
    let file = stack_var("PGPASSFILE");
    let text = std::fs::read_to_string(&file).expect("the stack's password file");
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let fields: Vec<&str> = line.splitn(5, ':').collect();
            (fields.get(3) == Some(&role)).then(|| fields[4].to_owned())
        })
        .unwrap_or_else(|| panic!("{role} is not in {file}"))
}

#[tokio::test]
async fn tcp_without_tls_is_refused() {
    if !tls_only() {
        eprintln!("STACK_SECURITY=plaintext: the server takes TCP without TLS by design");
        return;
    }
    let db = TestDb::create().await;
    for (role, url) in urls(&db) {
        let what = format!("{role} without TLS");
        let options = PgConnectOptions::from_str(&url).expect("a URL");
        let (code, error) = refusal(options.ssl_mode(PgSslMode::Disable), &what).await;
        assert_eq!(code.as_deref(), Some(NO_HBA_LINE), "{what}: {error}");
        assert!(error.to_string().contains("no encryption"), "{error}");
    }
}

#[tokio::test]
async fn the_server_is_verified_against_the_stacks_ca_only() {
    if !tls_only() {
        eprintln!("STACK_SECURITY=plaintext: no TLS to verify");
        return;
    }
    let db = TestDb::create().await;
    let options = PgConnectOptions::from_str(&db.url).expect("a URL");
    // The stack's CA.
    let mut conn = options
        .clone()
        .ssl_mode(PgSslMode::VerifyFull)
        .ssl_root_cert(stack_var("PGSSLROOTCERT"))
        .connect()
        .await
        .expect("verify-full against the stack's CA");
    let tls: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .expect("pg_stat_ssl");
    assert!(tls, "the connection is not TLS");
    let _ = conn.close().await;
    // The machine's public roots did not sign it: refused before any password.
    let (_, error) = refusal(
        options
            .ssl_mode(PgSslMode::VerifyFull)
            .ssl_root_cert("/etc/ssl/certs/ca-certificates.crt"),
        "a server no public CA signed, verified against the public roots",
    )
    .await;
    assert!(
        error.to_string().contains("UnknownIssuer"),
        "not refused for its issuer: {error}"
    );
}

#[tokio::test]
async fn the_server_trusts_nobody() {
    let db = TestDb::create().await;
    let mut owner = PgConnection::connect(&db.url).await.expect("owner");
    let rules: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT type, array_to_string(user_name, ','), coalesce(auth_method, error) \
         FROM pg_hba_file_rules ORDER BY line_number",
    )
    .fetch_all(&mut owner)
    .await
    .expect("pg_hba_file_rules");
    assert!(!rules.is_empty());
    for (kind, users, method) in &rules {
        match (kind.as_str(), method.as_str()) {
            // The superuser over the socket, as the server's own OS user.
            ("local", "peer") => assert_eq!(users, "postgres"),
            ("hostssl", "scram-sha-256") => {}
            ("host", "scram-sha-256") => assert!(!tls_only(), "a host line with TLS only"),
            _ => panic!("pg_hba.conf line {kind} {users} {method}: only SCRAM and peer"),
        }
    }
    // The stack's roles each have a SCRAM verifier; no role has a weaker
    // one (md5). A role with no password cannot sign in at all (SCRAM).
    let scram: Vec<String> = sqlx::query_scalar(
        "SELECT rolname::text FROM pg_authid \
         WHERE rolcanlogin AND rolpassword LIKE 'SCRAM-SHA-256$%' ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .expect("pg_authid");
    for role in std::iter::once("postgres").chain(ServiceRole::ALL.iter().map(|r| r.name())) {
        assert!(
            scram.iter().any(|r| r == role),
            "{role} has no SCRAM verifier"
        );
    }
    let weak: Vec<String> = sqlx::query_scalar(
        "SELECT rolname::text FROM pg_authid \
         WHERE rolpassword IS NOT NULL AND rolpassword NOT LIKE 'SCRAM-SHA-256$%'",
    )
    .fetch_all(&mut owner)
    .await
    .expect("pg_authid");
    assert!(weak.is_empty(), "roles with a weaker verifier: {weak:?}");
    let encryption: String = sqlx::query_scalar("SHOW password_encryption")
        .fetch_one(&mut owner)
        .await
        .expect("password_encryption");
    assert_eq!(encryption, "scram-sha-256");
}

#[cfg(unix)]
#[tokio::test]
async fn the_socket_and_the_data_directory_are_closed_to_other_users() {
    use std::os::unix::fs::PermissionsExt;
    let db = TestDb::create().await;
    let mut owner = PgConnection::connect(&db.url).await.expect("owner");
    let mut setting = async |name: &'static str| -> String {
        sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(&mut owner)
            .await
            .expect(name)
    };
    let data = setting("data_directory").await;
    let sockets = setting("unix_socket_directories").await;
    let socket_mode = setting("unix_socket_permissions").await;
    assert_eq!(socket_mode, "0700", "the socket itself");
    for dir in std::iter::once(data.as_str()).chain(sockets.split(',').map(str::trim)) {
        let mode = std::fs::metadata(dir)
            .unwrap_or_else(|e| panic!("{dir}: {e} (the stack's server runs on this machine)"))
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o077,
            0,
            "{dir} is open to other users: {:o}",
            mode & 0o777
        );
    }
    // The password file the clients read, as libpq demands it.
    let passfile = stack_var("PGPASSFILE");
    let mode = std::fs::metadata(&passfile)
        .expect("the password file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "{passfile}: {:o}", mode & 0o777);
}
