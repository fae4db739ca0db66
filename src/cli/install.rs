//! `metis install`: copies the running binary to `<cni-dir>/bin/metis` and,
//! optionally, a validated network config list into the runtime's config
//! directory. Both land atomically (temp file in the same directory, fsync,
//! rename, fsync of the directory), so a runtime never executes a half
//! written plugin or reads a half written config, and replacing a binary
//! that is executing at that moment is safe: the old file lives on until its
//! last user exits.

use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::ArgsError;
use crate::cni::conf;
use crate::flags::{self, FlagSpec};

/// Used when neither `--cni-dir` nor `$CNI_DIR` is set: the host's
/// `/opt/cni` as a DaemonSet usually mounts it (upstream's default).
pub const DEFAULT_CNI_DIR: &str = "/host/opt/cni";
/// The installed plugin's file name under `<cni-dir>/bin`.
pub const BINARY_NAME: &str = "metis";
/// Largest config list accepted (the plugin's own stdin limit).
const MAX_CONFLIST: u64 = 1024 * 1024;

const FLAGS: &[FlagSpec] = &[
    FlagSpec {
        name: "--cni-dir",
        value: Some("DIR"),
        repeatable: false,
        default: "$CNI_DIR, else /host/opt/cni",
        help: "CNI directory; the binary goes to DIR/bin/metis",
    },
    FlagSpec {
        name: "--conflist",
        value: Some("FILE"),
        repeatable: false,
        default: "",
        help: "also install this network config list (validated first; needs --net-dir)",
    },
    FlagSpec {
        name: "--net-dir",
        value: Some("DIR"),
        repeatable: false,
        default: "",
        help: "where the runtime reads network configs, e.g. /host/etc/cni/net.d",
    },
];

/// What to install where.
#[derive(Debug, PartialEq, Eq)]
pub struct Options {
    pub cni_dir: PathBuf,
    /// `(conflist file, net dir)`.
    pub conflist: Option<(PathBuf, PathBuf)>,
}

/// Why the installation did not happen; nothing is left half written.
#[derive(Debug)]
pub enum InstallError {
    /// The running executable cannot be found or read.
    Source(io::Error),
    /// A target directory does not exist or is not a directory.
    MissingDir(PathBuf),
    /// The config list cannot be read.
    ReadConflist { path: PathBuf, source: io::Error },
    /// The config list is not one Metis would accept.
    InvalidConflist { path: PathBuf, reason: String },
    /// Writing or renaming into place failed.
    Write { path: PathBuf, source: io::Error },
}

impl fmt::Display for InstallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InstallError::Source(err) => write!(f, "cannot read the running executable: {err}"),
            InstallError::MissingDir(dir) => {
                write!(f, "{} does not exist or is not a directory", dir.display())
            }
            InstallError::ReadConflist { path, source } => {
                write!(f, "cannot read {}: {source}", path.display())
            }
            InstallError::InvalidConflist { path, reason } => {
                write!(
                    f,
                    "{} is not a valid Metis config list: {reason}",
                    path.display()
                )
            }
            InstallError::Write { path, source } => {
                write!(f, "cannot install {}: {source}", path.display())
            }
        }
    }
}

impl std::error::Error for InstallError {}

pub fn usage() -> String {
    flags::usage(
        "metis install",
        "Copies this binary to the node's CNI bin directory atomically (safe while the old\n\
         binary runs) and, with --conflist and --net-dir, a network config list checked by\n\
         the plugin's own config parser. Nothing is written if the config list is invalid.",
        FLAGS,
    )
}

/// Parses the flags; `env_cni_dir` is `$CNI_DIR` (an empty one counts as unset).
pub fn parse(args: &[String], env_cni_dir: Option<String>) -> Result<Options, ArgsError> {
    let parsed = flags::parse(FLAGS, args).map_err(|err| ArgsError::from_flags(err, usage()))?;
    let cni_dir = parsed
        .get("--cni-dir")
        .map(str::to_string)
        .or(env_cni_dir.filter(|dir| !dir.is_empty()))
        .unwrap_or_else(|| DEFAULT_CNI_DIR.to_string());
    let conflist = match (parsed.get("--conflist"), parsed.get("--net-dir")) {
        (None, None) => None,
        (Some(file), Some(dir)) => Some((PathBuf::from(file), PathBuf::from(dir))),
        (Some(_), None) | (None, Some(_)) => {
            return Err(ArgsError::Usage {
                message: "--conflist and --net-dir go together".to_string(),
                usage: usage(),
            });
        }
    };
    let empty = |path: &Path| path.as_os_str().is_empty();
    if cni_dir.is_empty() || conflist.as_ref().is_some_and(|(f, d)| empty(f) || empty(d)) {
        return Err(ArgsError::Usage {
            message: "directory and file names must not be empty".to_string(),
            usage: usage(),
        });
    }
    Ok(Options {
        cni_dir: PathBuf::from(cni_dir),
        conflist,
    })
}

/// Installs `binary` (normally `std::env::current_exe()`) and the config
/// list, in that order, so a runtime that sees the config finds the plugin.
/// The config list is validated before anything is written. Returns the
/// installed paths.
pub fn run(options: &Options, binary: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let conflist = match &options.conflist {
        Some((file, net_dir)) => Some((read_conflist(file)?, file, net_dir)),
        None => None,
    };
    require_dir(&options.cni_dir)?;
    if let Some((_, _, net_dir)) = &conflist {
        require_dir(net_dir)?;
    }
    let bin_dir = options.cni_dir.join("bin");
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&bin_dir)
        .map_err(|source| InstallError::Write {
            path: bin_dir.clone(),
            source,
        })?;
    let mut installed = vec![install_binary(binary, &bin_dir)?];
    if let Some((bytes, file, net_dir)) = conflist {
        let name = file.file_name().unwrap_or(OsStr::new("metis.conflist"));
        installed.push(write_atomically(net_dir, name, 0o644, |out| {
            out.write_all(&bytes)
        })?);
    }
    Ok(installed)
}

fn require_dir(dir: &Path) -> Result<(), InstallError> {
    if dir.is_dir() {
        Ok(())
    } else {
        Err(InstallError::MissingDir(dir.to_path_buf()))
    }
}

fn install_binary(binary: &Path, bin_dir: &Path) -> Result<PathBuf, InstallError> {
    let mut source = File::open(binary).map_err(InstallError::Source)?;
    // Permission bits only: a set-id bit is never carried over.
    let mode = source
        .metadata()
        .map_err(InstallError::Source)?
        .permissions()
        .mode()
        & 0o777;
    write_atomically(bin_dir, OsStr::new(BINARY_NAME), mode, |out| {
        io::copy(&mut source, out).map(|_| ())
    })
}

/// Reads and validates a config list, returning its bytes unchanged.
fn read_conflist(path: &Path) -> Result<Vec<u8>, InstallError> {
    let read_err = |source| InstallError::ReadConflist {
        path: path.to_path_buf(),
        source,
    };
    let invalid = |reason: String| InstallError::InvalidConflist {
        path: path.to_path_buf(),
        reason,
    };
    if path.extension() != Some(OsStr::new("conflist")) {
        return Err(invalid(
            "the file name must end in .conflist, or runtimes read it as a single plugin config"
                .to_string(),
        ));
    }
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|file| file.take(MAX_CONFLIST + 1).read_to_end(&mut bytes))
        .map_err(read_err)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_CONFLIST {
        return Err(invalid(format!("larger than {MAX_CONFLIST} bytes")));
    }
    validate_conflist(&bytes).map_err(invalid)?;
    Ok(bytes)
}

/// Checks a config list the way a runtime will hand it to Metis: each plugin
/// that uses Metis (as `type` or as `ipam.type`) gets the list's
/// `cniVersion` and `name` injected, as libcni does, and must pass the
/// plugin's own config parser and have ranges to allocate from. At least
/// one plugin must use Metis.
pub fn validate_conflist(bytes: &[u8]) -> Result<(), String> {
    let list: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|err| format!("not JSON: {err}"))?;
    if !list.is_object() {
        return Err("not a JSON object".to_string());
    }
    let text = |key: &str| {
        list.get(key)
            .and_then(serde_json::Value::as_str)
            .filter(|value| !value.is_empty())
            .ok_or_else(|| format!("missing string {key:?}"))
    };
    let (cni_version, name) = (text("cniVersion")?, text("name")?);
    let plugins = list
        .get("plugins")
        .and_then(serde_json::Value::as_array)
        .filter(|plugins| !plugins.is_empty())
        .ok_or("missing non-empty \"plugins\" list")?;
    let mut uses_metis = false;
    for (index, plugin) in plugins.iter().enumerate() {
        let mut plugin = plugin
            .as_object()
            .ok_or_else(|| format!("plugins[{index}] is not an object"))?
            .clone();
        let is_metis = |value: Option<&serde_json::Value>| {
            value.and_then(serde_json::Value::as_str) == Some(BINARY_NAME)
        };
        if !is_metis(plugin.get("type"))
            && !is_metis(plugin.get("ipam").and_then(|ipam| ipam.get("type")))
        {
            continue;
        }
        uses_metis = true;
        plugin.insert("cniVersion".into(), cni_version.into());
        plugin.insert("name".into(), name.into());
        let injected = serde_json::Value::Object(plugin).to_string();
        conf::parse(injected.as_bytes())
            .and_then(|net_conf| net_conf.require_ranges())
            .map_err(|err| format!("plugins[{index}]: {} (CNI code {})", err.msg, err.code))?;
    }
    if uses_metis {
        Ok(())
    } else {
        Err("no plugin has type or ipam.type \"metis\"".to_string())
    }
}

/// Writes `dir/name` through a temp file in `dir` created exclusively with
/// `mode`, fsynced, renamed over the target, then fsyncs `dir`. The temp
/// file is removed on any failure.
fn write_atomically(
    dir: &Path,
    name: &OsStr,
    mode: u32,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> Result<PathBuf, InstallError> {
    let target = dir.join(name);
    let mut temp_name = OsStr::new(".").to_os_string();
    temp_name.push(name);
    temp_name.push(format!(".{}.tmp", std::process::id()));
    let temp = dir.join(temp_name);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temp)
        .and_then(|mut file| {
            fill(&mut file)?;
            // Set after writing: the create mode is subject to the umask.
            file.set_permissions(Permissions::from_mode(mode))?;
            file.sync_all()
        })
        .and_then(|()| fs::rename(&temp, &target))
        .and_then(|()| File::open(dir)?.sync_all());
    match written {
        Ok(()) => Ok(target),
        Err(source) => {
            let _ = fs::remove_file(&temp);
            Err(InstallError::Write {
                path: target,
                source,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn cni_dir_is_flag_then_env_then_default() {
        let dir = |list: &[&str], env: Option<&str>| {
            parse(&args(list), env.map(str::to_string)).unwrap().cni_dir
        };
        assert_eq!(dir(&["--cni-dir", "/a"], Some("/b")), PathBuf::from("/a"));
        assert_eq!(dir(&[], Some("/b")), PathBuf::from("/b"));
        assert_eq!(dir(&[], Some("")), PathBuf::from(DEFAULT_CNI_DIR));
        assert_eq!(dir(&[], None), PathBuf::from(DEFAULT_CNI_DIR));
    }

    #[test]
    fn conflist_needs_net_dir() {
        for list in [&["--conflist", "a.conflist"][..], &["--net-dir", "/d"][..]] {
            assert!(matches!(
                parse(&args(list), None),
                Err(ArgsError::Usage { .. })
            ));
        }
        assert!(matches!(
            parse(&args(&["--cni-dir="]), None),
            Err(ArgsError::Usage { .. })
        ));
    }

    const BRIDGE: &str = r#"{"cniVersion":"1.0.0","name":"pods","plugins":[
        {"type":"bridge","bridge":"cni0","ipam":{"type":"metis","ranges":[[{"subnet":"198.18.0.0/24"}]]}},
        {"type":"portmap","capabilities":{"portMappings":true}}]}"#;

    #[test]
    fn accepts_a_list_that_delegates_to_metis() {
        assert_eq!(validate_conflist(BRIDGE.as_bytes()), Ok(()));
    }

    #[test]
    fn rejects_lists_metis_would_refuse() {
        let cases = [
            ("[]", "not a JSON object"),
            ("{", "not JSON"),
            (r#"{"name":"x","plugins":[{"type":"metis"}]}"#, "cniVersion"),
            (
                r#"{"cniVersion":"1.0.0","name":"x","plugins":[]}"#,
                "plugins",
            ),
            (
                r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"bridge"}]}"#,
                "no plugin",
            ),
            (
                r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"metis"}]}"#,
                "no IPAM ranges",
            ),
            (
                r#"{"cniVersion":"9.9.9","name":"x","plugins":[{"type":"metis","ipam":{"ranges":[[{"subnet":"198.18.0.0/24"}]]}}]}"#,
                "CNI code 1",
            ),
            (
                r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"metis","ipam":{"ranges":[[{"subnet":"198.18.0.1/24"}]]}}]}"#,
                "plugins[0]",
            ),
        ];
        for (list, expected) in cases {
            let err = validate_conflist(list.as_bytes()).unwrap_err();
            assert!(err.contains(expected), "{list}: {err}");
        }
    }
}
