//! Every Kafka client a service makes starts from one base configuration:
//! the bootstrap servers, and the librdkafka properties of the service's
//! client config file (`--kafka-client-config`, `KAFKA_CLIENT_CONFIG`),
//! read by the library's [`ClientProperties`]. The file is where TLS and
//! SASL go; it is read at each client's creation, so a rotated password is
//! picked up by the next client, and its values are never logged nor put
//! in an error.

pub use effectively::kafka_config::{ClientProperties, ClientPropertiesError, client_config};
use rdkafka::ClientConfig;

impl crate::config::KafkaArgs {
    /// The base configuration of every client the service makes: its
    /// bootstrap servers and its client config file.
    ///
    /// # Errors
    /// As [`ClientProperties::load`].
    pub fn client_config(&self) -> Result<ClientConfig, ClientPropertiesError> {
        client_config(
            &self.kafka_bootstrap_servers,
            self.kafka_client_config.as_deref(),
        )
    }
}

/// `bootstrap.servers` of `config`, for messages.
pub fn servers_of(config: &ClientConfig) -> &str {
    config
        .get("bootstrap.servers")
        .unwrap_or("(no bootstrap.servers)")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn no_file_or_an_empty_name_is_the_bootstrap_servers_alone() {
        for none in [None, Some(Path::new(""))] {
            let config = client_config("h:1", none).expect("no file");
            assert_eq!(config.get("bootstrap.servers"), Some("h:1"));
            assert_eq!(config.get("security.protocol"), None);
        }
        let missing = client_config("h:1", Some(Path::new("/nonexistent/client.properties")))
            .expect_err("a missing file");
        assert!(
            missing
                .to_string()
                .contains("/nonexistent/client.properties"),
            "{missing}"
        );
    }
}
