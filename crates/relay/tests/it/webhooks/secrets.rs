//! Destination secrets sealed at rest under the key file, rotated by
//! `relay webhooks rekey`, and refused without a key.

use effectively::webhook::Secret;
use pipeline::db::ServiceRole;
use pipeline::testing::TestDb;
use relay::webhooks::{Keyring, SecretsArgs, Specs};
use sqlx::PgPool;

/// `relay webhooks add|rekey` as the relay's role, with the sealing keys of
/// `keys` (none: neither the file nor the environment's).
fn relay_webhooks(
    db: &TestDb,
    keys: Option<&std::path::Path>,
    args: &[&str],
) -> std::process::Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_relay"));
    command
        .arg("webhooks")
        .args(args)
        .env("DATABASE_URL", db.url_as(ServiceRole::Relay))
        .env_remove("RELAY_WEBHOOK_SECRETS_KEY_FILE")
        .env_remove(relay::webhooks::KEY_ENV)
        .env_remove("RELAY_UNSAFE_PLAINTEXT_WEBHOOK_SECRETS");
    if let Some(file) = keys {
        command.env("RELAY_WEBHOOK_SECRETS_KEY_FILE", file);
    }
    command.output().expect("run relay webhooks")
}

/// A key file of `lines` (0600) in `dir`.
fn key_file(dir: &std::path::Path, name: &str, lines: &[&str]) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n")).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    path
}

/// What `keys` reads of the destinations: their secrets, by name.
async fn readable(pool: &PgPool, keys: &std::path::Path) -> Vec<(String, usize)> {
    let specs = Specs::from_args(&SecretsArgs {
        webhook_secrets_key_file: Some(keys.to_owned()),
        unsafe_plaintext_webhook_secrets: false,
    })
    .expect("keys");
    relay::webhooks::active(pool, &specs)
        .await
        .expect("active")
        .into_iter()
        .map(|d| (d.name, d.secrets.len()))
        .collect()
}

#[tokio::test]
async fn destination_secrets_are_sealed_at_rest_rotated_by_rekey_and_need_a_key() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as the relay");
    let dir = tempfile::tempdir().expect("tempdir");
    let (old, new) = (Keyring::generate_line("old"), Keyring::generate_line("new"));
    let old_only = key_file(dir.path(), "old.key", &[&old]);
    let rotating = key_file(dir.path(), "rotating.key", &[&new, &old]);
    let new_only = key_file(dir.path(), "new.key", &[&new]);
    let secret = Secret::generate().to_whsec();
    // The secret from a file: it is in no process's arguments.
    let secret_file = key_file(dir.path(), "p.secret", &[&secret]);
    let spec = format!(
        "p=https://hooks.example.com/orders,secret-file={}",
        secret_file.display()
    );
    let stored = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT spec FROM orders.webhook_destinations WHERE destination = 'p'",
        )
        .fetch_optional(&owner)
        .await
        .expect("spec")
    };

    let refused = relay_webhooks(&db, None, &["add", &spec]);
    assert!(!refused.status.success(), "added without a key");
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("--webhook-secrets-key-file"), "{why}");
    assert_eq!(stored().await, None, "nothing stored");

    let added = relay_webhooks(&db, Some(&old_only), &["add", &spec]);
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let sealed = stored().await.expect("stored");
    assert!(sealed.starts_with("sealed:v1:old:"), "{sealed}");
    assert!(
        !sealed.contains(&secret[6..]) && !sealed.contains("example.com"),
        "neither the secret nor the URL in the database"
    );
    assert_eq!(
        readable(&relay_pool, &old_only).await,
        vec![("p".into(), 1)]
    );
    assert!(
        readable(&relay_pool, &new_only).await.is_empty(),
        "another key opens nothing"
    );

    // An older relay's plaintext row, next to it.
    sqlx::query(
        "INSERT INTO orders.webhook_destinations (destination, spec) VALUES ('legacy', $1)",
    )
    .bind(format!(
        "legacy=https://legacy.example.com/h,secret={secret}"
    ))
    .execute(&owner)
    .await
    .expect("a plaintext row");
    assert_eq!(
        relay::webhooks::plaintext(&relay_pool)
            .await
            .expect("plaintext"),
        vec!["legacy"]
    );

    // The rotation: the new key first, the old one kept; rekey; the old one dropped.
    let rekeyed = relay_webhooks(&db, Some(&rotating), &["rekey"]);
    assert!(
        rekeyed.status.success(),
        "{}",
        String::from_utf8_lossy(&rekeyed.stderr)
    );
    let said = String::from_utf8_lossy(&rekeyed.stdout);
    assert!(
        said.starts_with("2 destination specs sealed again under key new"),
        "{said}"
    );
    assert!(
        stored()
            .await
            .expect("stored")
            .starts_with("sealed:v1:new:")
    );
    assert!(
        relay::webhooks::plaintext(&relay_pool)
            .await
            .expect("plaintext")
            .is_empty()
    );
    assert_eq!(
        readable(&relay_pool, &new_only).await,
        vec![("legacy".into(), 1), ("p".into(), 1)],
        "the new key alone reads both"
    );
    assert!(
        readable(&relay_pool, &old_only).await.is_empty(),
        "the old key reads nothing now"
    );
    let again = relay_webhooks(&db, Some(&new_only), &["rekey"]);
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(
        said.starts_with("0 destination specs sealed again"),
        "{said}"
    );
}
