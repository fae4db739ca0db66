//! A small command-line flag parser shared by every subcommand:
//! `--name value`, `--name=value`, switches, repeatable flags and `--help`.
//! Unknown flags and bad values are usage errors (exit code 2).

use std::fmt;

/// One accepted flag.
pub struct FlagSpec {
    /// Spelling including dashes, e.g. `--socket-path` or `-v`.
    pub name: &'static str,
    /// Placeholder for the value (`PATH`), or `None` for a switch.
    pub value: Option<&'static str>,
    /// Whether the flag may be given more than once.
    pub repeatable: bool,
    /// Default shown in `--help` (empty for none).
    pub default: &'static str,
    pub help: &'static str,
}

/// `--db-path PATH`, defaulting to the node's database: the flag of every
/// command that works on one database file; `help` says what it does with it.
pub const fn db_path_flag(help: &'static str) -> FlagSpec {
    FlagSpec {
        name: "--db-path",
        value: Some("PATH"),
        repeatable: false,
        default: crate::defaults::DEFAULT_DB_PATH,
        help,
    }
}

/// The database a [`db_path_flag`] names.
pub fn db_path(parsed: &Parsed) -> std::path::PathBuf {
    std::path::PathBuf::from(
        parsed
            .get("--db-path")
            .unwrap_or(crate::defaults::DEFAULT_DB_PATH),
    )
}

/// A usage error, or a request for help.
#[derive(Debug, PartialEq, Eq)]
pub enum FlagError {
    Help,
    Unknown(String),
    MissingValue(&'static str),
    UnexpectedValue(&'static str),
    Repeated(&'static str),
    Positional(String),
    /// A flag's value failed validation: (flag, reason).
    BadValue(&'static str, String),
}

impl fmt::Display for FlagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlagError::Help => f.write_str("help requested"),
            FlagError::Unknown(flag) => write!(f, "unknown flag {flag:?}"),
            FlagError::MissingValue(flag) => write!(f, "flag {flag} needs a value"),
            FlagError::UnexpectedValue(flag) => write!(f, "flag {flag} takes no value"),
            FlagError::Repeated(flag) => write!(f, "flag {flag} given more than once"),
            FlagError::Positional(arg) => write!(f, "unexpected argument {arg:?}"),
            FlagError::BadValue(flag, reason) => write!(f, "invalid value for {flag}: {reason}"),
        }
    }
}

impl std::error::Error for FlagError {}

/// The flags found, in command-line order.
#[derive(Debug, Default)]
pub struct Parsed {
    values: Vec<(&'static str, String)>,
}

impl Parsed {
    /// The value of a single-valued flag, if given.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of a repeatable flag, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.values
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// Whether a switch was given.
    pub fn has(&self, name: &str) -> bool {
        self.values.iter().any(|(n, _)| *n == name)
    }
}

/// Exit status of a command given a bad command line.
pub const EXIT_USAGE: u8 = 2;

/// Parses `args` (without the program and subcommand names).
pub fn parse(specs: &[FlagSpec], args: &[String]) -> Result<Parsed, FlagError> {
    let mut parsed = Parsed::default();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        if arg == "-h" || arg == "--help" {
            return Err(FlagError::Help);
        }
        if !arg.starts_with('-') || arg == "-" {
            return Err(FlagError::Positional(arg.clone()));
        }
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) => (name, Some(value.to_string())),
            None => (arg.as_str(), None),
        };
        let spec = specs
            .iter()
            .find(|spec| spec.name == name)
            .ok_or_else(|| FlagError::Unknown(arg.clone()))?;
        let value = match (spec.value, inline) {
            (None, None) => String::new(),
            (None, Some(_)) => return Err(FlagError::UnexpectedValue(spec.name)),
            (Some(_), Some(value)) => value,
            (Some(_), None) => rest
                .next()
                .cloned()
                .ok_or(FlagError::MissingValue(spec.name))?,
        };
        if !spec.repeatable && parsed.has(spec.name) {
            return Err(FlagError::Repeated(spec.name));
        }
        parsed.values.push((spec.name, value));
    }
    Ok(parsed)
}

/// The `--help` text: usage line, description, then one line per flag.
pub fn usage(command: &str, about: &str, specs: &[FlagSpec]) -> String {
    let mut text = format!("Usage: {command} [flags]\n\n{about}\n\nFlags:\n");
    let rows: Vec<(String, &FlagSpec)> = specs
        .iter()
        .map(|spec| {
            let left = match spec.value {
                Some(placeholder) => format!("{} {placeholder}", spec.name),
                None => spec.name.to_string(),
            };
            (left, spec)
        })
        .collect();
    let width = rows.iter().map(|(left, _)| left.len()).max().unwrap_or(0);
    for (left, spec) in rows {
        text.push_str(&format!("  {left:<width$}  {}", spec.help));
        if !spec.default.is_empty() {
            text.push_str(&format!(" (default {})", spec.default));
        }
        if spec.repeatable {
            text.push_str(" [repeatable]");
        }
        text.push('\n');
    }
    text.push_str(&format!("  {:<width$}  show this help\n", "-h, --help"));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[FlagSpec] = &[
        FlagSpec {
            name: "--path",
            value: Some("PATH"),
            repeatable: false,
            default: "/x",
            help: "a path",
        },
        FlagSpec {
            name: "--cidr",
            value: Some("NET=CIDR"),
            repeatable: true,
            default: "",
            help: "a block",
        },
        FlagSpec {
            name: "--full",
            value: None,
            repeatable: false,
            default: "",
            help: "a switch",
        },
    ];

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_values_switches_and_repeats() {
        let parsed = parse(
            SPECS,
            &args(&["--path", "/a", "--cidr=a=1", "--cidr", "b=2", "--full"]),
        )
        .unwrap();
        assert_eq!(parsed.get("--path"), Some("/a"));
        assert_eq!(parsed.all("--cidr"), vec!["a=1", "b=2"]);
        assert!(parsed.has("--full"));
        assert_eq!(parsed.get("--missing"), None);
    }

    #[test]
    fn rejects_misuse() {
        let cases: &[(&[&str], FlagError)] = &[
            (&["--nope"], FlagError::Unknown("--nope".into())),
            (&["--path"], FlagError::MissingValue("--path")),
            (&["--full=yes"], FlagError::UnexpectedValue("--full")),
            (
                &["--path", "a", "--path", "b"],
                FlagError::Repeated("--path"),
            ),
            (&["stray"], FlagError::Positional("stray".into())),
            (&["--path", "a", "--help"], FlagError::Help),
        ];
        for (input, expected) in cases {
            assert_eq!(parse(SPECS, &args(input)).unwrap_err(), *expected);
        }
    }

    #[test]
    fn usage_lists_every_flag_with_defaults() {
        let text = usage("metis x", "About.", SPECS);
        assert!(text.contains("--path PATH"));
        assert!(text.contains("(default /x)"));
        assert!(text.contains("[repeatable]"));
        assert!(text.contains("--help"));
    }
}
