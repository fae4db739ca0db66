//! Line-oriented logging: one event per line, `time level component: message
//! key=value…`. The daemon logs to stderr; the plugin to its log file (its
//! stdout belongs to the CNI result). No logging crate: this is all we need.

use std::ffi::OsString;
use std::fmt::{self, Display, Write as _};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Severity, lowest number most important. `-v N` shows levels up to
/// `Info + N`, so `-v 1` adds `Debug` and `-v 4` adds `Trace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
    Trace = 6,
}

impl Level {
    fn label(self) -> &'static str {
        match self {
            Level::Error => "ERROR",
            Level::Warn => "WARN",
            Level::Info => "INFO",
            Level::Debug => "DEBUG",
            Level::Trace => "TRACE",
        }
    }
}

static MAX_LEVEL: AtomicU8 = AtomicU8::new(Level::Info as u8);
static SINK: Mutex<Option<Box<dyn Write + Send>>> = Mutex::new(None);
/// `key=value` fields added to every line (see [`set_context`]).
static CONTEXT: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Size at which the plugin's log file is rotated: 10 MiB.
pub const MAX_LOG_FILE_BYTES: u64 = 10 * 1024 * 1024;

/// Sends log lines to `sink` (stderr if never called) and sets verbosity.
pub fn init(sink: Box<dyn Write + Send>, verbosity: u8) {
    MAX_LEVEL.store(
        (Level::Info as u8).saturating_add(verbosity),
        Ordering::Relaxed,
    );
    if let Ok(mut guard) = SINK.lock() {
        *guard = Some(sink);
    }
}

/// Whether a message at `level` would be written.
pub fn enabled(level: Level) -> bool {
    level as u8 <= MAX_LEVEL.load(Ordering::Relaxed)
}

/// Writes one event. Values containing spaces, quotes or `=` are quoted.
pub fn log(level: Level, component: &str, message: &str, fields: &[(&str, &dyn Display)]) {
    if !enabled(level) {
        return;
    }
    let mut line = format!(
        "{} {:<5} {component}: {message}",
        rfc3339_millis(now_ms()),
        level.label()
    );
    if let Ok(context) = CONTEXT.lock() {
        for (key, value) in context.iter() {
            if !fields.iter().any(|(named, _)| named == key) {
                push_field(&mut line, key, value);
            }
        }
    }
    for (key, value) in fields {
        push_field(&mut line, key, &value.to_string());
    }
    line.push('\n');
    // A failed log write must never fail the operation being logged.
    if let Ok(mut guard) = SINK.lock() {
        match guard.as_mut() {
            Some(sink) => {
                let _ = sink.write_all(line.as_bytes());
                let _ = sink.flush();
            }
            None => {
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
        }
    }
}

/// Appends ` key=value`, quoting values with spaces, quotes, `=` or control
/// characters so one event stays one line.
fn push_field(line: &mut String, key: &str, value: &str) {
    let plain = !value.is_empty()
        && !value
            .chars()
            .any(|c| c.is_whitespace() || c == '"' || c == '=' || c.is_control());
    if plain {
        let _ = write!(line, " {key}={value}");
    } else {
        let _ = write!(line, " {key}={value:?}");
    }
}

/// Adds `fields` to every following line that does not name the key itself:
/// the plugin tags each line with its verb and container id this way.
pub fn set_context(fields: &[(&str, &dyn Display)]) {
    if let Ok(mut context) = CONTEXT.lock() {
        *context = fields
            .iter()
            .map(|(key, value)| ((*key).to_string(), value.to_string()))
            .collect();
    }
}

/// Opens `path` for appending (created with `mode`). A file that has
/// reached `max_bytes` is first renamed to `<path>.1`, replacing the previous
/// one, so the log never holds much more than twice `max_bytes`. Concurrent
/// openers serialise on an exclusive lock of the old file and rotate only if
/// `path` still names it, so a rotation is never repeated over fresh lines.
pub fn open_rotating(path: &Path, max_bytes: u64, mode: u32) -> io::Result<File> {
    let file = open_append(path, mode)?;
    if file.metadata()?.len() < max_bytes {
        return Ok(file);
    }
    let locked = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, errno)| io::Error::from(errno))?;
    let held = locked.metadata()?;
    let still_current = fs::metadata(path)
        .is_ok_and(|current| current.dev() == held.dev() && current.ino() == held.ino());
    if still_current && held.len() >= max_bytes {
        fs::rename(path, rotated_path(path))?;
    }
    drop(locked);
    open_append(path, mode)
}

/// `<path>.1`: where [`open_rotating`] moves a full log file.
pub fn rotated_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".1");
    PathBuf::from(name)
}

fn open_append(path: &Path, mode: u32) -> io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(mode)
        .open(path)
}

pub fn error(component: &str, message: &str, fields: &[(&str, &dyn Display)]) {
    log(Level::Error, component, message, fields);
}

pub fn warn(component: &str, message: &str, fields: &[(&str, &dyn Display)]) {
    log(Level::Warn, component, message, fields);
}

pub fn info(component: &str, message: &str, fields: &[(&str, &dyn Display)]) {
    log(Level::Info, component, message, fields);
}

pub fn debug(component: &str, message: &str, fields: &[(&str, &dyn Display)]) {
    log(Level::Debug, component, message, fields);
}

/// Periodic no-op events (a monitor pass that changed nothing, a watch
/// resumed): shown only with `-v 4` or more.
pub fn trace(component: &str, message: &str, fields: &[(&str, &dyn Display)]) {
    log(Level::Trace, component, message, fields);
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Formats Unix milliseconds as RFC 3339 UTC, e.g. `2026-11-29T17:08:04.123Z`.
pub fn rfc3339_millis(ms: i64) -> Rfc3339 {
    Rfc3339 { ms, millis: true }
}

/// Formats Unix milliseconds as RFC 3339 UTC without fractions, e.g.
/// `2026-11-29T17:08:04Z`.
pub fn rfc3339_seconds(ms: i64) -> Rfc3339 {
    Rfc3339 { ms, millis: false }
}

/// A lazily formatted RFC 3339 timestamp.
pub struct Rfc3339 {
    ms: i64,
    millis: bool,
}

impl Display for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.ms.div_euclid(1000);
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )?;
        if self.millis {
            write!(f, ".{:03}", self.ms.rem_euclid(1000))?;
        }
        f.write_str("Z")
    }
}

/// `2026-12-01T12:00:00Z` (optionally with a fraction) to Unix ms. Strict:
/// fixed-width ASCII digits (years 0000–9999) and in-range fields, so
/// text from the API server cannot overflow the arithmetic.
pub fn parse_rfc3339_ms(text: &str) -> Option<i64> {
    let (date, time) = text.strip_suffix('Z')?.split_once('T')?;
    let (clock, fraction) = match time.split_once('.') {
        Some((clock, fraction)) if !fraction.is_empty() => (clock, fraction),
        Some(_) => return None,
        None => (time, ""),
    };
    let number = |field: &str, width: usize| -> Option<i64> {
        (field.len() == width && field.bytes().all(|b| b.is_ascii_digit()))
            .then(|| field.parse().ok())
            .flatten()
    };
    let mut d = date.splitn(3, '-');
    let (year, month, day) = (
        number(d.next()?, 4)?,
        number(d.next()?, 2)?,
        number(d.next()?, 2)?,
    );
    let mut t = clock.splitn(3, ':');
    let (hour, minute, second) = (
        number(t.next()?, 2)?,
        number(t.next()?, 2)?,
        number(t.next()?, 2)?,
    );
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
        || !fraction.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let digits = &fraction[..3.min(fraction.len())];
    let millis = match digits.len() {
        0 => 0,
        n => digits.parse::<i64>().ok()? * 10i64.pow(3 - u32::try_from(n).ok()?),
    };
    let days = days_from_civil(year, month, day);
    Some(((days * 86_400 + hour * 3600 + minute * 60 + second) * 1000) + millis)
}

/// Howard Hinnant's `days_from_civil`, the inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since 1970-01-01 to (year, month, day), after Howard Hinnant's
/// `civil_from_days`.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339_millis(0).to_string(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339_millis(1_795_971_684_123).to_string(),
            "2026-11-29T17:01:24.123Z"
        );
        assert_eq!(
            rfc3339_seconds(951_782_400_000).to_string(),
            "2000-02-29T00:00:00Z"
        );
        assert_eq!(rfc3339_seconds(-1000).to_string(), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn rfc3339_parsing_is_strict_and_total() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:01.5Z"), Some(1500));
        assert_eq!(
            parse_rfc3339_ms("2026-11-29T17:01:24.123456Z"),
            Some(1_795_971_684_123)
        );
        assert_eq!(
            parse_rfc3339_ms("9999-12-31T23:59:59Z"),
            Some(253_402_300_799_000)
        );
        // Hostile or malformed: never a panic, never a wrong time.
        for bad in [
            "99999999999999999-01-01T00:00:00Z",
            "2026-1-01T00:00:00Z",
            "2026-01-01T-1:00:00Z",
            "2026-01-01T00:00:+1Z",
            "2026-01-01T00:00:00.Z",
            "2026-01-01T00:00:00.-5Z",
            "2026-01-01T00:00:00",
            "2026-01-01 00:00:00Z",
            "2026-02-30T24:00:00Z",
            " 2026-01-01T00:00:00Z",
            "",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn fields_that_could_break_a_line_are_quoted() {
        let mut line = String::new();
        push_field(&mut line, "error", "two\nlines");
        push_field(&mut line, "id", "c1");
        push_field(&mut line, "quote", "a\"b");
        assert_eq!(line, r#" error="two\nlines" id=c1 quote="a\"b""#);
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("metis-log-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn rotates_a_full_file_and_keeps_one() {
        let dir = scratch("rotate");
        let path = dir.join("cni.log");
        fs::write(&path, "old old\n").unwrap();
        fs::write(rotated_path(&path), "older\n").unwrap();
        let mut file = open_rotating(&path, 8, 0o644).unwrap();
        file.write_all(b"new\n").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new\n");
        assert_eq!(
            fs::read_to_string(rotated_path(&path)).unwrap(),
            "old old\n"
        );
        // Below the limit: appended to, not rotated.
        let mut again = open_rotating(&path, 8, 0o644).unwrap();
        again.write_all(b"more\n").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new\nmore\n");
        assert_eq!(
            fs::read_to_string(rotated_path(&path)).unwrap(),
            "old old\n"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rotation_reports_a_missing_directory() {
        let dir = scratch("missing");
        let path = dir.join("absent").join("cni.log");
        assert!(open_rotating(&path, 8, 0o644).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
