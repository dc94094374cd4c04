//! The inbox's unit tests: message ids, the time a copy is judged by, the
//! claim's margin.

use super::*;

#[test]
fn message_ids_are_bounded_text() {
    let now = Utc::now();
    assert!(Message::new("a", now, b"").is_ok());
    assert!(Message::new("x".repeat(255), now, b"").is_ok());
    assert!(Message::new("", now, b"").is_err());
    assert!(Message::new("x".repeat(256), now, b"").is_err());
    assert!(Message::new("a\0b", now, b"").is_err());
    let id = Uuid::now_v7();
    assert_eq!(
        Message::new(id, now, b"").expect("valid").id(),
        id.to_string()
    );
    assert_eq!(Message::v7(id, b"p").sent_at(), crate::v7::mint_time(id));
}

#[test]
fn a_uuidv7_id_is_judged_by_its_mint_time_any_other_by_when_it_was_sent() {
    let minted = crate::v7::minted_ago(Duration::from_secs(86_400));
    let now = Utc::now();
    for id in [MessageId::Uuid(minted), MessageId::Text(minted.to_string())] {
        let m = Message::new(id, now, b"").expect("valid");
        assert_eq!(m.sent_at(), crate::v7::mint_time(minted));
    }
    let v4 = Uuid::from_u128(0x6f1c_0b6e_8a1d_4c5e_9d3f_2b7a_1e0c_4d5f);
    assert_eq!(v4.get_version_num(), 4);
    assert_eq!(Message::new(v4, now, b"").expect("valid").sent_at(), now);
    assert_eq!(
        Message::new("order-7", now, b"").expect("valid").sent_at(),
        now
    );
}

#[test]
fn the_margin_is_an_eighth_of_the_retention_at_most_an_hour() {
    let schema = SchemaName::new("s").expect("valid");
    let inbox = Inbox::new(&schema, "c");
    assert_eq!(inbox.margin(), Duration::from_secs(3600));
    let short = inbox.retention(Duration::from_secs(80));
    assert_eq!(short.margin(), Duration::from_secs(10));
}
