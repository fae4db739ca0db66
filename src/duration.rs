//! Go duration syntax (`"30s"`, `"1h30m"`), shared by the network
//! configuration (`gcGracePeriod` and friends) and the daemon's flags, so
//! both accept exactly what upstream's Go code does.

/// Largest duration Go can express: `i64::MAX` nanoseconds (~292 years).
const MAX_DURATION_NS: u128 = i64::MAX.unsigned_abs() as u128;
/// Fraction digits beyond this are below a nanosecond for every unit.
const MAX_FRACTION_DIGITS: usize = 18;

/// Parses a Go duration (`"0"`, `"500ms"`, `"1h30m"`, `"1.5s"`) into whole
/// milliseconds, truncating. Units: ns, us, µs, μs, ms, s, m, h. A leading
/// `+` is allowed as in Go; negative, empty, unit-less (except `"0"`) or
/// over ~292 years gives `None`.
pub fn parse_duration_ms(text: &str) -> Option<i64> {
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest == "0" {
        return Some(0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total_ns: u128 = 0;
    while !rest.is_empty() {
        let (ns, tail) = duration_segment(rest)?;
        total_ns = total_ns.checked_add(ns).filter(|t| *t <= MAX_DURATION_NS)?;
        rest = tail;
    }
    i64::try_from(total_ns / 1_000_000).ok()
}

/// One `<number>[.<fraction>]<unit>` segment, in nanoseconds.
fn duration_segment(text: &str) -> Option<(u128, &str)> {
    let (int_digits, after) = split_digits(text);
    let (frac_digits, after) = match after.strip_prefix('.') {
        Some(after_dot) => split_digits(after_dot),
        None => ("", after),
    };
    if int_digits.is_empty() && frac_digits.is_empty() {
        return None;
    }
    let unit_len = after
        .find(|c: char| c.is_ascii_digit() || c == '.')
        .unwrap_or(after.len());
    let (unit, tail) = after.split_at(unit_len);
    let unit_ns: u128 = match unit {
        "ns" => 1,
        "us" | "µs" | "μs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return None,
    };
    let whole = digits_value(int_digits)?.checked_mul(unit_ns)?;
    let fraction = fraction_ns(frac_digits, unit_ns)?;
    Some((whole.checked_add(fraction)?, tail))
}

fn split_digits(text: &str) -> (&str, &str) {
    let len = text.bytes().take_while(u8::is_ascii_digit).count();
    text.split_at(len)
}

/// The value of ASCII digits; `None` beyond any representable duration.
fn digits_value(digits: &str) -> Option<u128> {
    digits.bytes().try_fold(0u128, |acc, b| {
        acc.checked_mul(10)?
            .checked_add(u128::from(b - b'0'))
            .filter(|v| *v <= MAX_DURATION_NS)
    })
}

fn fraction_ns(digits: &str, unit_ns: u128) -> Option<u128> {
    let kept = digits.get(..MAX_FRACTION_DIGITS).unwrap_or(digits);
    let value = digits_value(kept)?;
    let scale = 10u128.checked_pow(u32::try_from(kept.len()).ok()?)?;
    Some(value.checked_mul(unit_ns)? / scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        for (text, ms) in [
            ("0", 0),
            ("+0", 0),
            ("0s", 0),
            ("5m", 300_000),
            ("1h30m", 5_400_000),
            ("500ms", 500),
            ("1.5s", 1_500),
            (".5s", 500),
            ("1.s", 1_000),
            ("1500us", 1),
            ("1500µs", 1),
            ("1500μs", 1),
            ("999999ns", 0),
            ("1h1m1s1ms", 3_661_001),
            ("2562047h", 2_562_047 * 3_600_000),
            ("0.000000000000000000001h", 0),
        ] {
            assert_eq!(parse_duration_ms(text), Some(ms), "{text}");
        }
        for text in [
            "",
            "+",
            "-5m",
            "5",
            "5x",
            "m",
            ".s",
            "1..5s",
            "5m-1s",
            " 5m",
            "5m ",
            "1h 30m",
            "3000000h",
            "9223372036854775808ns",
            "99999999999999999999999999999999999999999h",
        ] {
            assert_eq!(parse_duration_ms(text), None, "{text}");
        }
    }
}
