//! Test support (feature `testing`): a fresh database per test on the real
//! PostgreSQL that `make up` started. No mocks: tests run against the stack.

use std::path::{Path, PathBuf};

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

/// Reads `NAME` from the environment, or else from the stack env file
/// (`.stack/env` at the workspace root) written by `scripts/stack.sh up`.
///
/// # Panics
/// When neither has it: the stack is not up.
pub fn stack_var(name: &str) -> String {
    if let Ok(value) = std::env::var(name) {
        return value;
    }
    let file = stack_env_file();
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("export "))
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not set and not in {}: start the stack with `make up`",
                file.display()
            )
        })
}

fn stack_env_file() -> PathBuf {
    if let Ok(dir) = std::env::var("STACK_DIR") {
        return Path::new(&dir).join("env");
    }
    // crates/<name> → workspace root
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.stack/env")
}

/// A database created for one test, with the migrations applied.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// Its name.
    pub name: String,
    /// Its connection URL.
    pub url: String,
}

impl TestDb {
    /// Creates `test_<uuid>` on the stack's server and migrates it.
    ///
    /// # Panics
    /// When the stack is down or the database cannot be created.
    pub async fn create() -> Self {
        let admin = stack_var("STACK_ADMIN_DATABASE_URL");
        let name = format!("test_{}", Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("connect to {admin}: {e} (is the stack up? `make up`)"));
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut conn)
            .await
            .expect("create test database");
        let _ = conn.close().await;
        let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(&admin);
        let url = format!("{base}/{name}");
        let pool = sqlx::PgPool::connect(&url).await.expect("connect test db");
        crate::db::MIGRATOR
            .run(&pool)
            .await
            .expect("migrate test db");
        pool.close().await;
        Self { name, url }
    }
}
