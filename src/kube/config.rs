//! Where the API server is and how to authenticate: a kubeconfig file (the
//! YAML kubectl writes; preferred when `KUBECONFIG` is set, as upstream) or
//! the in-cluster service account.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use yaml_rust2::{Yaml, YamlLoader};

/// The in-cluster service account's files.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Largest kubeconfig or credential file read.
const MAX_FILE: u64 = 1024 * 1024;

/// How requests authenticate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    None,
    Token(String),
    /// A bearer token re-read before every request, so rotation is seen.
    TokenFile(PathBuf),
}

/// TLS material, all PEM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tls {
    pub ca: Option<Vec<u8>>,
    pub client_cert: Option<Vec<u8>>,
    pub client_key: Option<Vec<u8>>,
    pub insecure: bool,
    /// The files the material was read from (not inline `-data`): read
    /// again when they change, so rotated credentials are used.
    pub files: TlsFiles,
}

/// Where each piece of TLS material lives on disk, if it does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    pub fn all(&self) -> impl Iterator<Item = &PathBuf> {
        [&self.ca, &self.client_cert, &self.client_key]
            .into_iter()
            .flatten()
    }
}

impl Tls {
    /// The same settings with every file-backed piece read again.
    pub fn reread(&self) -> Result<Tls, ConfigError> {
        let read = |file: &Option<PathBuf>, current: &Option<Vec<u8>>| match file {
            Some(path) => read_file(path).map(Some),
            None => Ok(current.clone()),
        };
        Ok(Tls {
            ca: read(&self.files.ca, &self.ca)?,
            client_cert: read(&self.files.client_cert, &self.client_cert)?,
            client_key: read(&self.files.client_key, &self.client_key)?,
            insecure: self.insecure,
            files: self.files.clone(),
        })
    }
}

/// Everything needed to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiConfig {
    /// `http(s)://host[:port]`, no trailing slash.
    pub server: String,
    pub auth: Auth,
    pub tls: Tls,
}

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kubernetes client configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Finds the cluster from the environment: `KUBECONFIG` first, then the
/// in-cluster service account. `Ok(None)` means no cluster is configured.
pub fn from_environment(
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<ApiConfig>, ConfigError> {
    if let Some(list) = lookup("KUBECONFIG").filter(|v| !v.is_empty()) {
        // Like kubectl, KUBECONFIG may list several files; Metis reads the
        // first that exists rather than merging them.
        let path = list
            .split(':')
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| ConfigError(format!("no file of KUBECONFIG={list} exists")))?;
        return from_kubeconfig(&path).map(Some);
    }
    match (
        lookup("KUBERNETES_SERVICE_HOST"),
        lookup("KUBERNETES_SERVICE_PORT"),
    ) {
        (Some(host), Some(port)) if !host.is_empty() && !port.is_empty() => Ok(Some(in_cluster(
            &host,
            &port,
            Path::new(SERVICE_ACCOUNT_DIR),
        )?)),
        _ => Ok(None),
    }
}

/// The service account's token (re-read on use) and CA bundle.
pub fn in_cluster(host: &str, port: &str, account_dir: &Path) -> Result<ApiConfig, ConfigError> {
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    let ca_path = account_dir.join("ca.crt");
    Ok(ApiConfig {
        server: format!("https://{host}:{port}"),
        auth: Auth::TokenFile(account_dir.join("token")),
        tls: Tls {
            ca: Some(read_file(&ca_path)?),
            files: TlsFiles {
                ca: Some(ca_path),
                ..TlsFiles::default()
            },
            ..Tls::default()
        },
    })
}

/// Reads a kubeconfig: its current context's cluster and user.
pub fn from_kubeconfig(path: &Path) -> Result<ApiConfig, ConfigError> {
    let text = String::from_utf8(read_file(path)?)
        .map_err(|_| ConfigError(format!("{} is not UTF-8", path.display())))?;
    let base = path.parent().unwrap_or(Path::new("."));
    kubeconfig_from_text(&text, base)
        .map_err(|ConfigError(msg)| ConfigError(format!("{}: {msg}", path.display())))
}

/// Reads a kubeconfig's text; files it names are relative to `base`.
pub fn kubeconfig_from_text(text: &str, base: &Path) -> Result<ApiConfig, ConfigError> {
    let docs = YamlLoader::load_from_str(text).map_err(|err| ConfigError(err.to_string()))?;
    let doc = docs
        .first()
        .ok_or_else(|| ConfigError("the kubeconfig is empty".into()))?;
    parse_kubeconfig(doc, base)
}

fn parse_kubeconfig(doc: &Yaml, base: &Path) -> Result<ApiConfig, ConfigError> {
    let context_name = doc["current-context"]
        .as_str()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ConfigError("no current-context".into()))?;
    let context = named(doc, "contexts", context_name, "context")?;
    let cluster_name =
        text(context, "cluster").ok_or_else(|| ConfigError("context names no cluster".into()))?;
    let cluster = named(doc, "clusters", cluster_name, "cluster")?;
    let server = text(cluster, "server")
        .ok_or_else(|| ConfigError(format!("cluster {cluster_name} has no server")))?
        .trim_end_matches('/')
        .to_string();
    if !(server.starts_with("https://") || server.starts_with("http://")) {
        return Err(ConfigError(format!(
            "server {server:?} is not an http(s) URL"
        )));
    }
    let (ca, ca_file) = material(cluster, "certificate-authority", base)?;
    let mut tls = Tls {
        ca,
        insecure: cluster["insecure-skip-tls-verify"]
            .as_bool()
            .unwrap_or(false),
        files: TlsFiles {
            ca: ca_file,
            ..TlsFiles::default()
        },
        ..Tls::default()
    };
    let auth = match text(context, "user") {
        None => Auth::None,
        Some(user_name) => {
            let user = named(doc, "users", user_name, "user")?;
            refuse_plugins(user, user_name)?;
            (tls.client_cert, tls.files.client_cert) = material(user, "client-certificate", base)?;
            (tls.client_key, tls.files.client_key) = material(user, "client-key", base)?;
            if tls.client_cert.is_some() != tls.client_key.is_some() {
                return Err(ConfigError(format!(
                    "user {user_name} needs both a client certificate and a client key"
                )));
            }
            match (text(user, "token"), text(user, "tokenFile")) {
                (Some(token), _) => Auth::Token(token.to_string()),
                (None, Some(file)) => Auth::TokenFile(resolve(base, file)),
                (None, None) => Auth::None,
            }
        }
    };
    Ok(ApiConfig { server, auth, tls })
}

/// Credential plugins (`exec`, `auth-provider`) are refused: Metis runs
/// no other program (the DaemonSet's service account needs none), and
/// requests without their credentials would only be refused one by one.
fn refuse_plugins(user: &Yaml, user_name: &str) -> Result<(), ConfigError> {
    for (key, what) in [
        ("exec", "an exec credential plugin"),
        ("auth-provider", "an auth-provider plugin"),
    ] {
        if !matches!(user[key], Yaml::BadValue | Yaml::Null) {
            return Err(ConfigError(format!(
                "user {user_name:?} authenticates with {what} (`{key}`), which is not supported: \
                 Metis runs no credential plugin; give it a token, a tokenFile or a client \
                 certificate (in a cluster, its service account)"
            )));
        }
    }
    Ok(())
}

/// The `inner` object of the entry named `name` in the list `list`.
fn named<'a>(doc: &'a Yaml, list: &str, name: &str, inner: &str) -> Result<&'a Yaml, ConfigError> {
    doc[list]
        .as_vec()
        .and_then(|entries| {
            entries
                .iter()
                .find(|entry| entry["name"].as_str() == Some(name))
        })
        .map(|entry| &entry[inner])
        .filter(|value| value.as_hash().is_some())
        .ok_or_else(|| ConfigError(format!("no {inner} named {name:?} in {list}")))
}

fn text<'a>(node: &'a Yaml, key: &str) -> Option<&'a str> {
    node[key].as_str().filter(|s| !s.is_empty())
}

/// A piece of PEM material and the file it came from, if any.
type Material = (Option<Vec<u8>>, Option<PathBuf>);

/// PEM from `KEY-data` (base64) or the file `KEY` (relative to the kubeconfig).
fn material(node: &Yaml, key: &str, base: &Path) -> Result<Material, ConfigError> {
    if let Some(data) = text(node, &format!("{key}-data")) {
        return base64_decode(data)
            .map(|pem| (Some(pem), None))
            .ok_or_else(|| ConfigError(format!("{key}-data is not valid base64")));
    }
    match text(node, key) {
        None => Ok((None, None)),
        Some(file) => {
            let path = resolve(base, file);
            Ok((Some(read_file(&path)?), Some(path)))
        }
    }
}

fn resolve(base: &Path, file: &str) -> PathBuf {
    let path = PathBuf::from(file);
    if path.is_absolute() {
        path
    } else {
        base.join(path)
    }
}

/// Reads a small credential or config file.
pub fn read_file(path: &Path) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    let file =
        fs::File::open(path).map_err(|err| ConfigError(format!("{}: {err}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|err| ConfigError(format!("{}: {err}", path.display())))?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_FILE {
        return Err(ConfigError(format!(
            "{} is larger than {MAX_FILE} bytes",
            path.display()
        )));
    }
    Ok(bytes)
}

/// Standard base64 with optional padding; whitespace ignored.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let mut buffer = 0u32;
    let mut bits = 0u32;
    for byte in text.bytes().filter(|b| !b.is_ascii_whitespace()) {
        let value = match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        buffer = (buffer << 6) | u32::from(value);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(u8::try_from((buffer >> bits) & 0xff).ok()?);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ApiConfig, ConfigError> {
        let docs = YamlLoader::load_from_str(text).unwrap();
        parse_kubeconfig(&docs[0], Path::new("/etc/kube"))
    }

    const KUBECTL_STYLE: &str = r#"apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTg==
    server: https://198.18.0.1:6443/
  name: edge
- cluster:
    server: http://127.0.0.1:8080
  name: local
contexts:
- context:
    cluster: edge
    user: admin
  name: edge-admin
- context:
    cluster: local
    user: robot
  name: local-robot
current-context: edge-admin
kind: Config
preferences: {}
users:
- name: admin
  user:
    token: s3cret
- name: robot
  user:
    tokenFile: tokens/robot
"#;

    #[test]
    fn reads_current_context() {
        let config = parse(KUBECTL_STYLE).unwrap();
        assert_eq!(config.server, "https://198.18.0.1:6443");
        assert_eq!(config.auth, Auth::Token("s3cret".into()));
        assert_eq!(config.tls.ca.as_deref(), Some(&b"-----BEGIN"[..]));
        let other = parse(&KUBECTL_STYLE.replace(
            "current-context: edge-admin",
            "current-context: local-robot",
        ))
        .unwrap();
        assert_eq!(other.server, "http://127.0.0.1:8080");
        assert_eq!(
            other.auth,
            Auth::TokenFile(PathBuf::from("/etc/kube/tokens/robot"))
        );
        assert_eq!(other.tls, Tls::default());
    }

    #[test]
    fn rejects_broken_kubeconfigs() {
        for (broken, why) in [
            (
                KUBECTL_STYLE.replace("current-context: edge-admin", "current-context: nope"),
                "no context named",
            ),
            (
                KUBECTL_STYLE.replace("current-context: edge-admin\n", ""),
                "no current-context",
            ),
            (
                KUBECTL_STYLE.replace("https://198.18.0.1:6443/", "ftp://x"),
                "not an http(s) URL",
            ),
            (
                KUBECTL_STYLE.replace("LS0tLS1CRUdJTg==", "not*base64"),
                "not valid base64",
            ),
            (
                KUBECTL_STYLE.replace(
                    "    token: s3cret",
                    "    exec:\n      command: gke-gcloud-auth-plugin",
                ),
                "exec credential plugin (`exec`), which is not supported",
            ),
            (
                KUBECTL_STYLE.replace("    token: s3cret", "    auth-provider:\n      name: gcp"),
                "(`auth-provider`), which is not supported",
            ),
        ] {
            let err = parse(&broken).unwrap_err();
            assert!(err.0.contains(why), "{err} lacks {why}");
        }
    }

    #[test]
    fn environment_precedence() {
        let none = from_environment(&|_| None).unwrap();
        assert_eq!(none, None);
        let missing = from_environment(&|k| {
            (k == "KUBECONFIG").then(|| "/nonexistent/a:/nonexistent/b".into())
        });
        assert!(missing.unwrap_err().0.contains("no file"));
        let dir = std::env::temp_dir().join(format!("metis-kubecfg-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config");
        fs::write(&file, KUBECTL_STYLE).unwrap();
        let path = file.display().to_string();
        // KUBECONFIG wins over the in-cluster variables.
        let found = from_environment(&|k| match k {
            "KUBECONFIG" => Some(path.clone()),
            "KUBERNETES_SERVICE_HOST" => Some("198.18.0.1".into()),
            "KUBERNETES_SERVICE_PORT" => Some("443".into()),
            _ => None,
        })
        .unwrap()
        .unwrap();
        assert_eq!(found.server, "https://198.18.0.1:6443");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn in_cluster_reads_service_account() {
        let dir = std::env::temp_dir().join(format!("metis-sa-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("ca.crt"), b"PEM").unwrap();
        let config = in_cluster("2001:db8::1", "443", &dir).unwrap();
        assert_eq!(config.server, "https://[2001:db8::1]:443");
        assert_eq!(config.auth, Auth::TokenFile(dir.join("token")));
        assert_eq!(config.tls.ca.as_deref(), Some(&b"PEM"[..]));
        fs::remove_dir_all(&dir).unwrap();
        assert!(in_cluster("h", "1", &dir).is_err());
    }

    #[test]
    fn base64_round_trips_known_values() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVs\nbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("").unwrap(), b"");
        assert!(base64_decode("a$b").is_none());
    }
}
