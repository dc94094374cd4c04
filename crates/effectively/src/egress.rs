//! Where a webhook sender may connect (feature `webhooks`): a guard against
//! server-side request forgery.
//!
//! A webhook destination is a URL someone typed. Without a guard, a sender
//! posts to whatever it names: the metadata service of the cloud it runs in
//! (`169.254.169.254`), a database on loopback, an admin port on the private
//! network, and keeps the first bytes of the answer where its operator can
//! read them. [`Egress`] refuses every address that is not public unless an
//! operator's allowlist names it, and refuses it **at connection time**: the
//! client's resolver ([`Egress::resolver`]) answers only the permitted
//! addresses of a name, so a name that resolved to a public address when the
//! destination was added and to `127.0.0.1` at the attempt (DNS rebinding)
//! is refused at the attempt. An address written in the URL is not resolved
//! by the client, so [`Egress::check_url`] judges it before the request.
//! [`Egress::client_builder`] puts both together with no redirect followed
//! and no proxy taken from the environment (a proxy would connect for it,
//! past the resolver).
//!
//! ```
//! use effectively::egress::{Egress, Refused};
//!
//! let egress = Egress::public_only();
//! assert!(egress.check("93.184.215.14".parse().unwrap()).is_ok());
//! assert!(matches!(
//!     egress.check("169.254.169.254".parse().unwrap()),
//!     Err(Refused { .. })
//! ));
//! // The embedded demo's receiver, allowed by name of its network.
//! let demo = Egress::public_only().allow("127.0.0.1/32".parse().unwrap());
//! assert!(demo.check("127.0.0.1".parse().unwrap()).is_ok());
//! assert!(demo.check("127.0.0.2".parse().unwrap()).is_err());
//! ```

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Why an address is not public.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// `0.0.0.0/8`, `::`: "this host"; connecting to it reaches loopback.
    Unspecified,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `10.0.0.0/8`, `172.16.0.0/12`, `192.168.0.0/16` (RFC 1918).
    Private,
    /// `100.64.0.0/10` (RFC 6598, carrier-grade NAT; a cloud's internal
    /// services live there too).
    Shared,
    /// `169.254.0.0/16`, `fe80::/10`.
    LinkLocal,
    /// `fc00::/7` (RFC 4193), and the deprecated site-local `fec0::/10`.
    UniqueLocal,
    /// A cloud's instance metadata service: `169.254.169.254`,
    /// `fd00:ec2::254`, `100.100.100.200`.
    Metadata,
    /// Multicast, broadcast, documentation, benchmarking and reserved
    /// ranges: nothing a receiver lives at.
    Reserved,
}

impl Class {
    /// Its name in an error: `loopback`, `private`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::Loopback => "loopback",
            Self::Private => "private",
            Self::Shared => "shared (carrier-grade NAT)",
            Self::LinkLocal => "link-local",
            Self::UniqueLocal => "unique-local",
            Self::Metadata => "cloud metadata",
            Self::Reserved => "reserved",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The class of `ip` when it is not a public address; `None` when it is.
/// An IPv6 address that carries an IPv4 one (IPv4-mapped `::ffff:a.b.c.d`,
/// NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) is judged by the IPv4 address
/// it reaches.
pub fn classify(ip: IpAddr) -> Option<Class> {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<Class> {
    let [a, b, c, d] = ip.octets();
    Some(match (a, b, c, d) {
        (169, 254, 169, 254) | (100, 100, 100, 200) => Class::Metadata,
        (0, ..) => Class::Unspecified,
        (127, ..) => Class::Loopback,
        (10, ..) | (192, 168, ..) => Class::Private,
        (172, b, ..) if (16..32).contains(&b) => Class::Private,
        (100, b, ..) if (64..128).contains(&b) => Class::Shared,
        (169, 254, ..) => Class::LinkLocal,
        // 192.0.0.0/24 (IETF protocol assignments), 192.0.2.0/24,
        // 198.51.100.0/24, 203.0.113.0/24 (documentation), 198.18.0.0/15
        // (benchmarking), 224.0.0.0/4 (multicast), 240.0.0.0/4 (reserved,
        // the broadcast address among them).
        (192, 0, 0 | 2, _) | (198, 51, 100, _) | (203, 0, 113, _) => Class::Reserved,
        (198, 18 | 19, ..) => Class::Reserved,
        (224.., ..) => Class::Reserved,
        _ => return None,
    })
}

fn classify_v6(ip: Ipv6Addr) -> Option<Class> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return classify_v4(v4);
    }
    let s = ip.segments();
    // NAT64 (RFC 6052): the last 32 bits are the IPv4 address reached.
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return classify_v4(Ipv4Addr::from((u32::from(s[6]) << 16) | u32::from(s[7])));
    }
    // 6to4 (RFC 3056): bits 16..48 are the IPv4 address of the relay.
    if s[0] == 0x2002 {
        return classify_v4(Ipv4Addr::from((u32::from(s[1]) << 16) | u32::from(s[2])));
    }
    Some(match s {
        [0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x254] => Class::Metadata,
        _ if ip.is_unspecified() => Class::Unspecified,
        _ if ip.is_loopback() => Class::Loopback,
        [first, ..] if first & 0xffc0 == 0xfe80 => Class::LinkLocal,
        [first, ..] if first & 0xfe00 == 0xfc00 || first & 0xffc0 == 0xfec0 => Class::UniqueLocal,
        // Multicast, documentation (2001:db8::/32), discard (100::/64),
        // IPv4-compatible (::a.b.c.d, deprecated), Teredo (2001::/32).
        [first, ..] if first >> 8 == 0xff => Class::Reserved,
        [0x2001, 0x0db8, ..] | [0x2001, 0, ..] | [0x0100, 0, 0, 0, ..] => Class::Reserved,
        [0, 0, 0, 0, 0, 0, ..] => Class::Reserved,
        _ => return None,
    })
}

/// An address the sender must not connect to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ip} is a {class} address, which webhooks may not reach unless an allowlist names it")]
pub struct Refused {
    /// The address.
    pub ip: IpAddr,
    /// Why it is not public.
    pub class: Class,
}

/// Why a URL may not be posted to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlRefused {
    /// Neither `http` nor `https`, or no host.
    #[error("{0:?} is not an http(s) URL with a host")]
    NotHttp(String),
    /// Plain `http` where `https` is required.
    #[error("{0} is plain http: webhooks go over https unless plain http is allowed for it")]
    PlainHttp(String),
    /// Its host is an address that is not permitted.
    #[error(transparent)]
    Address(#[from] Refused),
}

/// Which addresses a sender may connect to: every public one, and the
/// networks of an operator's allowlist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Egress {
    allowed: Vec<IpNet>,
}

impl Egress {
    /// Public addresses only (see [`classify`]).
    pub fn public_only() -> Self {
        Self::default()
    }

    /// The same policy with `net` allowed too (e.g. `127.0.0.1/32` for a
    /// receiver on the sender's own host, `10.1.2.0/24` for one on the
    /// private network).
    pub fn allow(mut self, net: IpNet) -> Self {
        self.allowed.push(net.trunc());
        self
    }

    /// The allowlist.
    pub fn allowed(&self) -> &[IpNet] {
        &self.allowed
    }

    /// `Ok` when the sender may connect to `ip`.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refused> {
        match classify(ip) {
            Some(class) if !self.allowed.iter().any(|net| net.contains(&ip)) => {
                Err(Refused { ip, class })
            }
            _ => Ok(()),
        }
    }

    /// `Ok` when `url` may be posted to: `https` (or `http` when
    /// `allow_http`), and a host that is a name (the resolver judges its
    /// addresses at connection time) or a permitted address.
    pub fn check_url(&self, url: &reqwest::Url, allow_http: bool) -> Result<(), UrlRefused> {
        match url.scheme() {
            "https" => {}
            "http" if allow_http => {}
            "http" => return Err(UrlRefused::PlainHttp(redacted(url))),
            _ => return Err(UrlRefused::NotHttp(redacted(url))),
        }
        let Some(host) = url.host_str() else {
            return Err(UrlRefused::NotHttp(redacted(url)));
        };
        // An IPv6 host is written in brackets; a name does not parse.
        match host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            Ok(ip) => Ok(self.check(ip)?),
            Err(_) => Ok(()),
        }
    }

    /// A resolver that answers a name's permitted addresses only, and an
    /// error naming the first refused one when none is permitted.
    pub fn resolver(&self) -> Arc<Resolver> {
        Arc::new(Resolver {
            egress: self.clone(),
        })
    }

    /// A client builder that connects only where this policy permits: its
    /// [`resolver`](Self::resolver), no redirect followed (a redirect's
    /// target is a URL nobody checked), no proxy from the environment.
    /// Check each URL with [`check_url`](Self::check_url) too: an address
    /// written in the URL is not resolved.
    pub fn client_builder(&self) -> reqwest::ClientBuilder {
        reqwest::Client::builder()
            .dns_resolver(self.resolver())
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
    }
}

/// `url` without its user, password and query (a token often rides in
/// one), for errors and logs.
pub fn redacted(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    if shown.query().is_some() {
        shown.set_query(Some("…"));
    }
    shown.to_string()
}

/// [`Egress::resolver`]: the system's resolver (tokio's `lookup_host`), its
/// answers filtered by the policy. Give it to a client with
/// `reqwest::ClientBuilder::dns_resolver`.
#[derive(Debug)]
pub struct Resolver {
    egress: Egress,
}

impl Resolve for Resolver {
    fn resolve(&self, name: Name) -> Resolving {
        let egress = self.egress.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let mut refused = None;
            let permitted: Vec<SocketAddr> = found
                .into_iter()
                .filter(|addr| match egress.check(addr.ip()) {
                    Ok(()) => true,
                    Err(r) => {
                        refused.get_or_insert(r);
                        false
                    }
                })
                .collect();
            if permitted.is_empty() {
                let reason: Box<dyn std::error::Error + Send + Sync> = match refused {
                    Some(r) => format!("{host} resolves to {r}").into(),
                    None => format!("{host} resolves to no address").into(),
                };
                return Err(reason);
            }
            let addrs: Addrs = Box::new(permitted.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(ip: &str) -> Option<Class> {
        classify(ip.parse().expect(ip))
    }

    #[test]
    fn every_class_is_told_apart_from_public_addresses() {
        for (ip, wanted) in [
            ("0.0.0.0", Some(Class::Unspecified)),
            ("127.0.0.1", Some(Class::Loopback)),
            ("127.255.0.9", Some(Class::Loopback)),
            ("10.1.2.3", Some(Class::Private)),
            ("172.16.0.1", Some(Class::Private)),
            ("172.31.255.255", Some(Class::Private)),
            ("172.32.0.1", None),
            ("192.168.1.1", Some(Class::Private)),
            ("100.64.0.1", Some(Class::Shared)),
            ("100.128.0.1", None),
            ("169.254.1.1", Some(Class::LinkLocal)),
            ("169.254.169.254", Some(Class::Metadata)),
            ("100.100.100.200", Some(Class::Metadata)),
            ("192.0.2.10", Some(Class::Reserved)),
            ("224.0.0.1", Some(Class::Reserved)),
            ("255.255.255.255", Some(Class::Reserved)),
            ("8.8.8.8", None),
            ("93.184.215.14", None),
            ("::", Some(Class::Unspecified)),
            ("::1", Some(Class::Loopback)),
            ("fe80::1", Some(Class::LinkLocal)),
            ("fd12:3456::1", Some(Class::UniqueLocal)),
            ("fc00::1", Some(Class::UniqueLocal)),
            ("fd00:ec2::254", Some(Class::Metadata)),
            ("ff02::1", Some(Class::Reserved)),
            ("2001:db8::1", Some(Class::Reserved)),
            ("::ffff:127.0.0.1", Some(Class::Loopback)),
            ("::ffff:169.254.169.254", Some(Class::Metadata)),
            ("64:ff9b::a00:1", Some(Class::Private)),
            ("2002:7f00:1::", Some(Class::Loopback)),
            ("::127.0.0.1", Some(Class::Reserved)),
            ("2606:4700:4700::1111", None),
            ("::ffff:8.8.8.8", None),
        ] {
            assert_eq!(class(ip), wanted, "{ip}");
        }
    }

    #[test]
    fn the_allowlist_admits_its_networks_and_nothing_else() {
        let egress = Egress::public_only()
            .allow("127.0.0.1/32".parse().expect("net"))
            .allow("10.9.0.7/24".parse().expect("net"));
        assert!(egress.check("127.0.0.1".parse().expect("ip")).is_ok());
        assert!(egress.check("10.9.0.200".parse().expect("ip")).is_ok());
        let refused = egress
            .check("10.9.1.1".parse().expect("ip"))
            .expect_err("outside the /24");
        assert_eq!(refused.class, Class::Private);
        assert!(
            refused
                .to_string()
                .contains("10.9.1.1 is a private address")
        );
        assert!(egress.check("::1".parse().expect("ip")).is_err());
        assert_eq!(egress.allowed()[1].to_string(), "10.9.0.0/24");
    }

    #[test]
    fn urls_need_https_unless_allowed_and_a_permitted_literal_address() {
        let egress = Egress::public_only();
        let url = |u: &str| reqwest::Url::parse(u).expect(u);
        assert!(
            egress
                .check_url(&url("https://example.com/h"), false)
                .is_ok()
        );
        assert!(matches!(
            egress.check_url(&url("http://example.com/h"), false),
            Err(UrlRefused::PlainHttp(_))
        ));
        assert!(egress.check_url(&url("http://example.com/h"), true).is_ok());
        assert!(matches!(
            egress.check_url(&url("https://127.0.0.1:8443/h"), false),
            Err(UrlRefused::Address(Refused {
                class: Class::Loopback,
                ..
            }))
        ));
        assert!(matches!(
            egress.check_url(&url("https://[::ffff:10.0.0.1]/h"), false),
            Err(UrlRefused::Address(Refused {
                class: Class::Private,
                ..
            }))
        ));
        assert!(matches!(
            egress.check_url(&url("ftp://example.com/"), true),
            Err(UrlRefused::NotHttp(_))
        ));
    }

    #[test]
    fn redacted_urls_keep_no_credentials_or_query() {
        let url = reqwest::Url::parse("https://user:hunter2@example.com/h?token=abc").expect("url");
        let shown = redacted(&url);
        assert!(!shown.contains("hunter2") && !shown.contains("user") && !shown.contains("abc"));
        assert!(shown.starts_with("https://example.com/h?"), "{shown}");
    }

    /// A name is judged by what it resolves to when the client connects:
    /// `localhost` (a name, so [`Egress::check_url`] passes it) resolves to
    /// loopback and is refused by the resolver, the way a rebound name is.
    #[tokio::test]
    async fn a_name_that_resolves_to_loopback_is_refused_by_the_resolver() {
        let refused = Egress::public_only()
            .resolver()
            .resolve("localhost".parse::<Name>().expect("a name"))
            .await
            .err()
            .expect("refused");
        assert!(refused.to_string().contains("loopback"), "{refused}");
        let allowed = Egress::public_only()
            .allow("127.0.0.0/8".parse().expect("net"))
            .allow("::1/128".parse().expect("net"))
            .resolver()
            .resolve("localhost".parse::<Name>().expect("a name"))
            .await
            .map(|addrs| addrs.count())
            .unwrap_or(0);
        assert!(allowed > 0, "allowed, localhost resolves");
    }
}
