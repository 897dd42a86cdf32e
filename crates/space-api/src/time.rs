//! A moment as the API carries it.

use std::fmt;
use std::time::{Duration, SystemTime};

/// A moment in UTC. On the wire it is RFC 3339 with milliseconds
/// (`2026-12-05T23:09:27.123Z`), the one format every time of the API has
/// always had; in code it is a point in time that compares, orders and
/// subtracts as one, so no caller parses or compares time text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(SystemTime);

impl Timestamp {
    pub fn now() -> Timestamp {
        Timestamp::from(SystemTime::now())
    }

    /// Reads RFC 3339 (`Z` or no offset, any fraction of a second).
    pub fn parse(text: &str) -> Option<Timestamp> {
        humantime::parse_rfc3339_weak(text).ok().map(Timestamp::from)
    }

    pub fn system_time(self) -> SystemTime {
        self.0
    }

    /// How long ago this was from `now` (zero if it is later).
    pub fn age_at(self, now: SystemTime) -> Duration {
        now.duration_since(self.0).unwrap_or_default()
    }

    /// Seconds since the Unix epoch.
    pub fn unix_seconds(self) -> u64 {
        self.0.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs()
    }
}

impl From<SystemTime> for Timestamp {
    /// Kept to the millisecond, as the wire carries it, so that a time read
    /// back equals the time written.
    fn from(time: SystemTime) -> Timestamp {
        let since = time.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let millis = Duration::from_millis(since.as_millis() as u64);
        Timestamp(SystemTime::UNIX_EPOCH + millis)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_rfc3339_millis(self.0))
    }
}

impl serde::Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Timestamp, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Timestamp::parse(&text).ok_or_else(|| serde::de::Error::custom(format!("{text:?} is not an RFC 3339 time")))
    }
}

impl utoipa::PartialSchema for Timestamp {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(utoipa::openapi::KnownFormat::DateTime)))
            .examples(["2026-12-05T23:09:27.123Z"])
            .into()
    }
}

impl utoipa::ToSchema for Timestamp {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_is_written_as_the_api_always_wrote_times_and_read_back_equal() {
        let at = Timestamp::parse("2026-12-05T23:09:27.123Z").unwrap();
        assert_eq!(serde_json::to_string(&at).unwrap(), "\"2026-12-05T23:09:27.123Z\"");
        assert_eq!(serde_json::from_str::<Timestamp>("\"2026-12-05T23:09:27.123Z\"").unwrap(), at);
        let now = Timestamp::now();
        assert_eq!(Timestamp::parse(&now.to_string()), Some(now), "milliseconds survive a round trip");
        // Times written without a fraction, or with more of one, still read.
        assert!(Timestamp::parse("2026-01-01T00:10:00Z").unwrap() < at);
        assert_eq!(Timestamp::parse("2026-12-05T23:09:27.123456Z"), Some(at));
    }

    #[test]
    fn text_that_is_not_a_time_is_refused_with_what_it_was() {
        let err = serde_json::from_str::<Timestamp>("\"yesterday\"").unwrap_err();
        assert!(err.to_string().contains("\"yesterday\" is not an RFC 3339 time"), "{err}");
        assert!(Timestamp::parse("2026-13-01T00:00:00Z").is_none());
    }
}
