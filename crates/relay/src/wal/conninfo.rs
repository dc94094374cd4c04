//! The replication connection's URL, completed the way libpq completes one.
//!
//! The relay's pool (sqlx) and every `psql` take what a URL leaves out from
//! libpq's environment: the password from `PGPASSWORD` or the password file
//! (`PGPASSFILE`, else `~/.pgpass`), TLS from `PGSSLMODE` and
//! `PGSSLROOTCERT`. The replication client reads only its URL, so the same
//! URL would connect the pool with a password and TLS and the stream with
//! neither. [`replication_url`] fills the same gaps from the same places, so
//! both connections authenticate and verify the server alike; a value the URL
//! gives wins, as in libpq. The password goes into the URL in memory only
//! (never logged: [`redacted`] is what errors show).

use std::path::{Path, PathBuf};

use anyhow::Context;
use url::Url;

/// An environment variable's value, `None` when unset.
type Var = Box<dyn Fn(&str) -> Option<String>>;

/// Where libpq reads what a URL leaves out: the environment (`var`) and the
/// home directory (for `~/.pgpass`).
pub(super) struct Libpq {
    /// An environment variable's value.
    pub(super) var: Var,
    /// The user's home directory.
    pub(super) home: Option<PathBuf>,
}

impl Libpq {
    /// The process's own environment.
    pub(super) fn process() -> Self {
        Self {
            var: Box::new(|name| std::env::var(name).ok().filter(|v| !v.is_empty())),
            home: std::env::var_os("HOME").map(PathBuf::from),
        }
    }
}

/// `url` as a replication connection (`replication=database`) with what
/// libpq would add: the password (`PGPASSWORD`, then the password file) when
/// the URL has none, `sslmode` from `PGSSLMODE` and `sslrootcert` from
/// `PGSSLROOTCERT` when the URL does not say.
///
/// # Errors
/// When `url` is not a URL.
pub(super) fn replication_url(url: &str, env: &Libpq) -> anyhow::Result<String> {
    let mut parsed = Url::parse(url).context("the database URL is not a URL")?;
    let given: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
    let has = |key: &str| given.iter().any(|k| k == key);
    if parsed.password().is_none() {
        let password = (env.var)("PGPASSWORD").or_else(|| {
            let file = (env.var)("PGPASSFILE")
                .map(PathBuf::from)
                .or_else(|| env.home.as_ref().map(|h| h.join(".pgpass")))?;
            password_from_file(&file, &Target::of(&parsed, env))
        });
        if let Some(password) = password {
            parsed
                .set_password(Some(&password))
                .map_err(|()| anyhow::anyhow!("the database URL cannot carry a password"))?;
        }
    }
    {
        let mut query = parsed.query_pairs_mut();
        for (key, var) in [("sslmode", "PGSSLMODE"), ("sslrootcert", "PGSSLROOTCERT")] {
            if !has(key)
                && let Some(value) = (env.var)(var)
            {
                query.append_pair(key, &value);
            }
        }
        if !has("replication") {
            query.append_pair("replication", "database");
        }
    }
    Ok(parsed.to_string())
}

/// `url` with its password replaced by `***`, for errors and logs.
pub(super) fn redacted(url: &str) -> String {
    match Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(parsed) => parsed.to_string(),
        Err(_) => "<not a URL>".into(),
    }
}

/// What a password file's line is matched against.
#[derive(Debug, PartialEq)]
struct Target {
    host: String,
    port: String,
    database: String,
    user: String,
}

impl Target {
    /// libpq's defaults for what the URL leaves out: `PGHOST` or `localhost`,
    /// `PGPORT` or 5432, the user's name for the database.
    fn of(url: &Url, env: &Libpq) -> Self {
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        let host = url
            .host_str()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
            .or_else(|| (env.var)("PGHOST"))
            .unwrap_or_else(|| "localhost".into());
        let port = url
            .port()
            .map(|p| p.to_string())
            .or_else(|| (env.var)("PGPORT"))
            .unwrap_or_else(|| "5432".into());
        let user = Some(decode(url.username()))
            .filter(|u| !u.is_empty())
            .or_else(|| (env.var)("PGUSER"))
            .unwrap_or_default();
        let database = Some(decode(url.path().trim_start_matches('/')))
            .filter(|d| !d.is_empty())
            .or_else(|| (env.var)("PGDATABASE"))
            .unwrap_or_else(|| user.clone());
        Self {
            host,
            port,
            database,
            user,
        }
    }
}

/// The password of the first line of `file` that matches `target`, as libpq
/// reads it: `host:port:database:user:password`, `*` matching anything, `\`
/// escaping `:` and `\`, `#` starting a comment line. A file others may read
/// is ignored with a warning (libpq does the same).
fn password_from_file(file: &Path, target: &Target) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(file).ok()?.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                file = %file.display(),
                "the password file is readable by others (not 0600): not read"
            );
            return None;
        }
    }
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .filter(|line| !line.trim_start().starts_with('#') && !line.trim().is_empty())
        .find_map(|line| {
            let fields = split_fields(line);
            let [host, port, database, user, password] = fields.as_slice() else {
                return None;
            };
            let matches = |pattern: &String, value: &str| pattern == "*" || pattern == value;
            (matches(host, &target.host)
                && matches(port, &target.port)
                && matches(database, &target.database)
                && matches(user, &target.user))
            .then(|| password.clone())
        })
}

/// A password file's line split at its unescaped colons, escapes removed
/// (the password, last, keeps any further colons).
fn split_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    fields.last_mut().expect("one field at least").push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut().expect("one field at least").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// libpq's environment holding `vars` only, and no home directory.
    fn libpq(vars: HashMap<&'static str, String>) -> Libpq {
        Libpq {
            var: Box::new(move |name| vars.get(name).cloned()),
            home: None,
        }
    }

    fn passfile(text: &str, mode: u32) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("a temporary file");
        file.write_all(text.as_bytes()).expect("write it");
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(mode))
            .expect("set its mode");
        file
    }

    #[test]
    fn a_url_gets_its_password_and_tls_from_libpqs_environment() {
        let file = passfile(
            "# comment\n127.0.0.1:25432:*:someone_else:no\n127.0.0.1:25432:*:effectively_relay:s3cr:t\n",
            0o600,
        );
        let libpq = libpq(HashMap::from([
            ("PGPASSFILE", file.path().display().to_string()),
            ("PGSSLMODE", "verify-full".to_string()),
            ("PGSSLROOTCERT", "/stack/tls/ca.crt".to_string()),
        ]));
        let url = replication_url(
            "postgres://effectively_relay@127.0.0.1:25432/effectively",
            &libpq,
        )
        .expect("a URL");
        assert_eq!(
            url,
            "postgres://effectively_relay:s3cr%3At@127.0.0.1:25432/effectively\
             ?sslmode=verify-full&sslrootcert=%2Fstack%2Ftls%2Fca.crt&replication=database"
        );
    }

    #[test]
    fn what_the_url_says_wins() {
        let file = passfile("*:*:*:*:from-file\n", 0o600);
        let libpq = libpq(HashMap::from([
            ("PGPASSFILE", file.path().display().to_string()),
            ("PGPASSWORD", "from-env".to_string()),
            ("PGSSLMODE", "verify-full".to_string()),
        ]));
        assert_eq!(
            replication_url("postgres://u:given@h:1/db?sslmode=disable", &libpq).expect("a URL"),
            "postgres://u:given@h:1/db?sslmode=disable&replication=database"
        );
        // PGPASSWORD before the file, as in libpq.
        assert_eq!(
            replication_url("postgres://u@h:1/db?sslmode=disable", &libpq).expect("a URL"),
            "postgres://u:from-env@h:1/db?sslmode=disable&replication=database"
        );
    }

    #[test]
    fn a_password_file_others_can_read_is_not_read() {
        let file = passfile("*:*:*:*:leaked\n", 0o644);
        let libpq = libpq(HashMap::from([(
            "PGPASSFILE",
            file.path().display().to_string(),
        )]));
        assert_eq!(
            replication_url("postgres://u@h/db", &libpq).expect("a URL"),
            "postgres://u@h/db?replication=database"
        );
    }

    #[test]
    fn password_file_lines_match_field_by_field() {
        let file = passfile(
            "h:5432:other:u:wrong-db\nh:5432:db:u:right\\:colon\\\\slash\n",
            0o600,
        );
        let target = Target {
            host: "h".into(),
            port: "5432".into(),
            database: "db".into(),
            user: "u".into(),
        };
        assert_eq!(
            password_from_file(file.path(), &target).as_deref(),
            Some("right:colon\\slash")
        );
        // libpq's defaults: port 5432, the database named after the user.
        let libpq = libpq(HashMap::new());
        let url = Url::parse("postgres://u@h").expect("a URL");
        assert_eq!(
            Target::of(&url, &libpq),
            Target {
                host: "h".into(),
                port: "5432".into(),
                database: "u".into(),
                user: "u".into()
            }
        );
    }

    #[test]
    fn errors_show_no_password() {
        assert_eq!(
            redacted("postgres://u:secret@h/db?replication=database"),
            "postgres://u:***@h/db?replication=database"
        );
        assert_eq!(redacted("not a url"), "<not a URL>");
    }
}
