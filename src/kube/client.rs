//! A small blocking Kubernetes API client on `ureq`: JSON GET, POST, PUT,
//! JSON merge PATCH and line-delimited watch streams. Every request has a
//! deadline; watches have a server-side timeout and a read deadline.

use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use ureq::Agent;
use ureq::tls::{Certificate, ClientCert, PemItem, PrivateKey, RootCerts, TlsConfig};

use super::config::{ApiConfig, Auth, Tls, read_file};

/// Deadline for one ordinary request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest JSON body, and longest watch event line, accepted from the API
/// server: etcd stores no object above 1.5 MiB, and a NodeNetworkConfig
/// within the entry caps of `nnc` is far smaller. A larger answer is an
/// error (the daemon degrades) rather than memory the DaemonSet lacks.
pub const MAX_BODY: u64 = 2 * 1024 * 1024;
/// Largest streamed body (a LIST page): read as it arrives and kept only as
/// the caller's compact objects, so this bounds the bytes read, not the
/// memory; a page of objects at the entry caps still fits.
pub const MAX_STREAMED_BODY: u64 = 256 * 1024 * 1024;

/// A failed API call.
#[derive(Debug)]
pub enum KubeError {
    /// The client could not be set up (bad TLS material, …).
    Config(String),
    /// No HTTP response: connection refused, timeout, TLS failure.
    Transport(String),
    /// The server answered with a non-success status (and maybe a
    /// `Retry-After`).
    Status {
        code: u16,
        body: String,
        retry_after: Option<Duration>,
    },
    /// The body is not the JSON expected.
    Decode(String),
}

impl KubeError {
    pub fn is_status(&self, code: u16) -> bool {
        matches!(self, KubeError::Status { code: c, .. } if *c == code)
    }

    /// How long the server asked us to wait, if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            KubeError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

impl fmt::Display for KubeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KubeError::Config(msg) => write!(f, "client setup: {msg}"),
            KubeError::Transport(msg) => write!(f, "API server unreachable: {msg}"),
            KubeError::Status { code, body, .. } => {
                let body: String = body.chars().take(300).collect();
                write!(f, "API server answered {code}: {body}")
            }
            KubeError::Decode(msg) => write!(f, "unexpected API response: {msg}"),
        }
    }
}

impl std::error::Error for KubeError {}

/// One event of a watch stream.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchEvent {
    /// `ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK` or `ERROR`.
    pub kind: String,
    pub object: Value,
}

pub struct ApiClient {
    server: String,
    auth: Auth,
    longest_watch: Duration,
    tls: Mutex<TlsState>,
}

/// The agents built from the TLS material in use, and what it was read from.
struct TlsState {
    material: Tls,
    /// (device, inode, length, modification time) of each file it was
    /// read from when it was read.
    stamps: Vec<Option<FileStamp>>,
    /// A handshake failed since: read the files again before the next
    /// request even if they look unchanged.
    suspect: bool,
    agents: Result<(Agent, Agent), String>,
}

type FileStamp = (u64, u64, u64, i64, i64);

impl ApiClient {
    /// A client; `longest_watch` bounds how long one watch stream may last.
    pub fn new(config: &ApiConfig, longest_watch: Duration) -> Result<ApiClient, KubeError> {
        let client = ApiClient::new_or_broken(config, longest_watch);
        client.agents()?;
        Ok(client)
    }

    /// Like [`ApiClient::new`], but bad client settings (a malformed CA,
    /// key or certificate) give a client whose every request fails with
    /// them: the daemon serves its local blocks and reports itself
    /// degraded, as for any other TLS failure, instead of not starting.
    /// File-backed material (CA bundle, client certificate and key) is
    /// read again whenever a file changes or a TLS handshake failed, like
    /// the token, so rotated credentials are used without a restart.
    pub fn new_or_broken(config: &ApiConfig, longest_watch: Duration) -> ApiClient {
        let stamps = stamps(&config.tls);
        let agents = build_agents(config, &config.tls, longest_watch);
        ApiClient {
            server: config.server.clone(),
            auth: config.auth.clone(),
            longest_watch,
            tls: Mutex::new(TlsState {
                material: config.tls.clone(),
                stamps,
                suspect: false,
                agents,
            }),
        }
    }

    /// The agents for the next request: rebuilt first when the TLS files
    /// changed or a handshake failed since they were read.
    fn agents(&self) -> Result<(Agent, Agent), KubeError> {
        let mut state = self.tls.lock().unwrap_or_else(PoisonError::into_inner);
        let now = stamps(&state.material);
        if state.suspect || now != state.stamps {
            state.suspect = false;
            state.stamps = now;
            match state.material.reread() {
                Ok(material) => {
                    if material != state.material || state.agents.is_err() {
                        let config = ApiConfig {
                            server: self.server.clone(),
                            auth: self.auth.clone(),
                            tls: material.clone(),
                        };
                        state.agents = build_agents(&config, &material, self.longest_watch);
                        crate::log::info(
                            "kube",
                            "TLS material changed on disk; using it",
                            &[("usable", &state.agents.is_ok())],
                        );
                    }
                    state.material = material;
                }
                Err(err) => state.agents = Err(err.to_string()),
            }
        }
        state.agents.clone().map_err(KubeError::Config)
    }

    /// Notes a failed request: a TLS failure makes the next request read
    /// the material again (a rotated CA or certificate).
    fn failed<T>(&self, result: Result<T, KubeError>) -> Result<T, KubeError> {
        if let Err(KubeError::Transport(why)) = &result
            && is_tls_failure(why)
        {
            self.tls
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .suspect = true;
        }
        result
    }

    pub fn get(&self, path: &str) -> Result<Value, KubeError> {
        let (agent, _) = self.agents()?;
        let request = agent.get(self.url(path));
        let response = with_auth(request, &self.auth)?.call();
        self.failed(json_body(response))
    }

    /// A GET whose JSON body `seed` reads as it arrives (a LIST page turned
    /// into the caller's objects one at a time): neither the body's text
    /// nor its whole tree is held at once.
    pub fn get_streamed<T, S>(&self, path: &str, seed: S) -> Result<T, KubeError>
    where
        S: for<'de> serde::de::DeserializeSeed<'de, Value = T>,
    {
        let (agent, _) = self.agents()?;
        let request = agent.get(self.url(path));
        let response = with_auth(request, &self.auth)?.call();
        self.failed(streamed_body(response, seed))
    }

    pub fn post<T: Serialize + ?Sized>(&self, path: &str, body: &T) -> Result<Value, KubeError> {
        let body = encode(body)?;
        let (agent, _) = self.agents()?;
        let request = agent.post(self.url(path)).content_type("application/json");
        let response = with_auth(request, &self.auth)?.send(body);
        self.failed(json_body(response))
    }

    /// A whole-object update (the controller's status writes); the body's
    /// `metadata.resourceVersion` is the precondition (a stale one answers
    /// 409).
    pub fn put<T: Serialize + ?Sized>(&self, path: &str, body: &T) -> Result<Value, KubeError> {
        self.put_text(path, encode(body)?)
    }

    /// [`ApiClient::put`] of a body already serialised.
    pub fn put_text(&self, path: &str, body: String) -> Result<Value, KubeError> {
        let (agent, _) = self.agents()?;
        let request = agent.put(self.url(path)).content_type("application/json");
        let response = with_auth(request, &self.auth)?.send(body);
        self.failed(json_body(response))
    }

    /// A DELETE with DeleteOptions (`preconditions.resourceVersion` makes
    /// it a compare-and-delete: a stale version answers 409).
    pub fn delete(&self, path: &str, options: &Value) -> Result<Value, KubeError> {
        let (agent, _) = self.agents()?;
        let request = agent
            .delete(self.url(path))
            .force_send_body()
            .content_type("application/json");
        let response = with_auth(request, &self.auth)?.send(options.to_string());
        self.failed(json_body(response))
    }

    /// A JSON merge patch (RFC 7386); include `metadata.resourceVersion` for
    /// optimistic concurrency (a stale version answers 409).
    pub fn merge_patch(&self, path: &str, body: &Value) -> Result<Value, KubeError> {
        let (agent, _) = self.agents()?;
        let request = agent
            .patch(self.url(path))
            .content_type("application/merge-patch+json");
        let response = with_auth(request, &self.auth)?.send(body.to_string());
        self.failed(json_body(response))
    }

    /// Opens a watch; `path` must already carry `watch=true` and the
    /// resource version. Events are read lazily from the stream.
    pub fn watch(&self, path: &str) -> Result<WatchStream, KubeError> {
        let (_, watch_agent) = self.agents()?;
        let request = watch_agent.get(self.url(path));
        let mut response = self.failed(
            with_auth(request, &self.auth)?
                .call()
                .map_err(|err| KubeError::Transport(err.to_string())),
        )?;
        if let Some(refused) = refusal(&mut response) {
            return Err(refused);
        }
        Ok(WatchStream {
            reader: BufReader::new(Box::new(response.into_body().into_reader())),
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server)
    }
}

/// Events of one watch, one JSON object per line.
pub struct WatchStream {
    reader: BufReader<Box<dyn Read + Send>>,
}

impl Iterator for WatchStream {
    type Item = Result<WatchEvent, KubeError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let mut line = Vec::new();
            let read = (&mut self.reader)
                .take(MAX_BODY)
                .read_until(b'\n', &mut line);
            match read {
                Ok(0) => return None,
                Ok(_) if line.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(_) => return Some(parse_event(&line)),
                Err(err) => return Some(Err(KubeError::Transport(err.to_string()))),
            }
        }
    }
}

/// A request body as JSON text (a typed object or a `Value`).
fn encode<T: Serialize + ?Sized>(body: &T) -> Result<String, KubeError> {
    serde_json::to_string(body).map_err(|err| KubeError::Decode(format!("request body: {err}")))
}

/// A watch event line as sent.
#[derive(Deserialize)]
struct EventLine {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    object: Value,
}

/// One line of a watch stream: `{"type": ..., "object": ...}`.
pub fn parse_event(line: &[u8]) -> Result<WatchEvent, KubeError> {
    let EventLine { kind, object } = serde_json::from_slice(line)
        .map_err(|err| KubeError::Decode(format!("watch event: {err}")))?;
    let kind = kind.ok_or_else(|| KubeError::Decode("watch event without a type".into()))?;
    Ok(WatchEvent { kind, object })
}

fn with_auth<B>(
    request: ureq::RequestBuilder<B>,
    auth: &Auth,
) -> Result<ureq::RequestBuilder<B>, KubeError> {
    let token = match auth {
        Auth::None => return Ok(request),
        Auth::Token(token) => token.clone(),
        Auth::TokenFile(path) => {
            let bytes = read_file(path).map_err(|err| KubeError::Config(err.to_string()))?;
            String::from_utf8_lossy(&bytes).trim().to_string()
        }
    };
    Ok(request.header("Authorization", format!("Bearer {token}")))
}

fn json_body(
    response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<Value, KubeError> {
    let mut response = response.map_err(|err| KubeError::Transport(err.to_string()))?;
    let status = response.status().as_u16();
    let retry_after = retry_after(&response);
    let body = response
        .body_mut()
        .with_config()
        .limit(MAX_BODY)
        .read_to_string()
        .map_err(|err| KubeError::Transport(err.to_string()))?;
    if !(200..300).contains(&status) {
        return Err(KubeError::Status {
            code: status,
            body,
            retry_after,
        });
    }
    serde_json::from_str(&body).map_err(|err| KubeError::Decode(err.to_string()))
}

/// The error a response that is not a 2xx answers, with its status, body
/// (as far as it can be read: the status is what callers act on) and
/// `Retry-After`; `None` for a 2xx, whose body is left unread.
fn refusal(response: &mut ureq::http::Response<ureq::Body>) -> Option<KubeError> {
    let code = response.status().as_u16();
    if (200..300).contains(&code) {
        return None;
    }
    let retry_after = retry_after(response);
    let body = response
        .body_mut()
        .with_config()
        .limit(MAX_BODY)
        .read_to_string()
        .unwrap_or_default();
    Some(KubeError::Status {
        code,
        body,
        retry_after,
    })
}

fn streamed_body<T, S>(
    response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    seed: S,
) -> Result<T, KubeError>
where
    S: for<'de> serde::de::DeserializeSeed<'de, Value = T>,
{
    let mut response = response.map_err(|err| KubeError::Transport(err.to_string()))?;
    if let Some(refused) = refusal(&mut response) {
        return Err(refused);
    }
    let reader = BufReader::new(
        response
            .into_body()
            .into_with_config()
            .limit(MAX_STREAMED_BODY)
            .reader(),
    );
    let mut json = serde_json::Deserializer::from_reader(reader);
    let decoded = seed
        .deserialize(&mut json)
        .and_then(|value| json.end().map(|()| value));
    decoded.map_err(|err| match err.classify() {
        serde_json::error::Category::Io => KubeError::Transport(err.to_string()),
        _ => KubeError::Decode(err.to_string()),
    })
}

/// `Retry-After` in seconds (the API server never sends an HTTP date).
fn retry_after<B>(response: &ureq::http::Response<B>) -> Option<Duration> {
    let value = response.headers().get("retry-after")?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The two agents (ordinary requests, watches) for `tls`, or why there
/// can be none.
fn build_agents(
    config: &ApiConfig,
    tls: &Tls,
    longest_watch: Duration,
) -> Result<(Agent, Agent), String> {
    let tls = tls_config(&config.server, tls).map_err(|err| match err {
        KubeError::Config(why) => why,
        other => other.to_string(),
    })?;
    let agent: Agent = Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(REQUEST_TIMEOUT))
        .tls_config(tls.clone())
        .build()
        .into();
    let watch_agent: Agent = Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(REQUEST_TIMEOUT))
        .timeout_recv_response(Some(REQUEST_TIMEOUT))
        .timeout_recv_body(Some(longest_watch.saturating_add(Duration::from_secs(30))))
        .tls_config(tls)
        .build()
        .into();
    Ok((agent, watch_agent))
}

/// What the files of `tls` look like now (`None`: unreadable).
fn stamps(tls: &Tls) -> Vec<Option<FileStamp>> {
    use std::os::unix::fs::MetadataExt;
    tls.files
        .all()
        .map(|path| {
            std::fs::metadata(path)
                .ok()
                .map(|m| (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
        })
        .collect()
}

/// Whether a transport error came from TLS (a certificate the server or
/// we no longer accept), after which the material is read again.
fn is_tls_failure(why: &str) -> bool {
    let why = why.to_ascii_lowercase();
    ["tls", "certificate", "handshake", "issuer", "alert"]
        .iter()
        .any(|word| why.contains(word))
}

fn tls_config(server: &str, tls: &Tls) -> Result<TlsConfig, KubeError> {
    // No bundled public roots (they would cost every plugin run memory):
    // an API server is verified against the CA its configuration names.
    let https = server.starts_with("https://");
    if https && tls.ca.is_none() && !tls.insecure {
        return Err(KubeError::Config(format!(
            "{server} needs a CA: set certificate-authority(-data) in the kubeconfig"
        )));
    }
    let mut builder = TlsConfig::builder().disable_verification(tls.insecure);
    if let Some(ca) = &tls.ca {
        let certs = pem_certificates(ca)?;
        if certs.is_empty() {
            return Err(KubeError::Config(
                "the CA bundle holds no certificate".into(),
            ));
        }
        builder = builder.root_certs(RootCerts::Specific(Arc::new(certs)));
    }
    if let (Some(cert), Some(key_pem)) = (&tls.client_cert, &tls.client_key) {
        let chain = pem_certificates(cert)?;
        let key = PrivateKey::from_pem(key_pem)
            .map_err(|err| KubeError::Config(format!("client key: {err}")))?;
        check_client_pair(&chain, key_pem)?;
        builder = builder.client_cert(Some(ClientCert::new_with_certs(&chain, key)));
    }
    Ok(builder.build())
}

/// Refuses a client certificate and key TLS could not use — no
/// certificate, a key of another certificate (a rotation half done: the
/// certificate file is new, the key file not yet), a key it cannot load —
/// with the check TLS itself makes on its first connection, where a
/// failure is a panic inside `ureq`, not an error.
fn check_client_pair(chain: &[Certificate<'_>], key_pem: &[u8]) -> Result<(), KubeError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    if chain.is_empty() {
        return Err(KubeError::Config(
            "the client certificate file holds no certificate".into(),
        ));
    }
    let key_der = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|err| KubeError::Config(format!("client key: {err}")))?;
    let chain = chain
        .iter()
        .map(|cert| CertificateDer::from(cert.der().to_vec()))
        .collect();
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain, key_der, &provider)
        .map(drop)
        .map_err(|err| match err {
            rustls::Error::InconsistentKeys(_) => {
                KubeError::Config("the client key does not belong to the client certificate".into())
            }
            other => KubeError::Config(format!("client certificate and key: {other}")),
        })
}

fn pem_certificates(pem: &[u8]) -> Result<Vec<Certificate<'static>>, KubeError> {
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(pem) {
        match item.map_err(|err| KubeError::Config(format!("PEM: {err}")))? {
            PemItem::Certificate(cert) => certs.push(cert),
            PemItem::PrivateKey(_) => {}
            _ => {}
        }
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_watch_events() {
        let event =
            parse_event(br#"{"type":"MODIFIED","object":{"metadata":{"resourceVersion":"7"}}}"#)
                .unwrap();
        assert_eq!(event.kind, "MODIFIED");
        assert_eq!(event.object["metadata"]["resourceVersion"], "7");
        assert!(parse_event(b"{}").is_err());
        assert!(parse_event(b"not json").is_err());
    }

    /// A self-signed CA certificate (P-256), only ever parsed.
    const TEST_CA: &str = include_str!("../../testdata/kube/test-ca.pem");

    #[test]
    fn a_rotated_ca_file_is_read_again_without_a_restart() {
        let dir = crate::testutil::TempDir::new();
        let ca = dir.0.join("ca.crt");
        std::fs::write(&ca, b"not pem").unwrap();
        let config = ApiConfig {
            // Nothing listens there: a request that gets past the TLS
            // setup fails in transport, one that does not fails in setup.
            server: "https://127.0.0.1:9".into(),
            auth: Auth::None,
            tls: super::super::config::Tls {
                ca: Some(b"not pem".to_vec()),
                files: super::super::config::TlsFiles {
                    ca: Some(ca.clone()),
                    ..Default::default()
                },
                ..Default::default()
            },
        };
        let client = ApiClient::new_or_broken(&config, Duration::from_secs(60));
        assert!(matches!(client.get("/api"), Err(KubeError::Config(_))));
        // The CA is replaced on disk: the next request uses it.
        std::fs::write(&ca, TEST_CA).unwrap();
        let err = client.get("/api").err().unwrap();
        assert!(matches!(err, KubeError::Transport(_)), "{err}");
        // Broken again (a bad rotation): said, not ignored.
        std::fs::write(&ca, b"still not pem, and longer").unwrap();
        assert!(matches!(client.get("/api"), Err(KubeError::Config(_))));
        assert!(is_tls_failure("invalid peer certificate: UnknownIssuer"));
        assert!(is_tls_failure("io: received fatal alert: UnknownCA"));
        assert!(!is_tls_failure("Connection refused"));
    }

    #[test]
    fn bad_tls_material_is_a_config_error() {
        let config = ApiConfig {
            server: "https://198.18.0.1".into(),
            auth: Auth::None,
            tls: super::super::config::Tls {
                ca: Some(b"not pem".to_vec()),
                ..Default::default()
            },
        };
        let watch = Duration::from_secs(60);
        assert!(matches!(
            ApiClient::new(&config, watch),
            Err(KubeError::Config(_))
        ));
        // The daemon's client: every request fails with the reason, unsent.
        let broken = ApiClient::new_or_broken(&config, watch);
        let err = broken.get("/api/v1/nodes/n1").err().unwrap();
        assert!(
            err.to_string().contains("PEM") || err.to_string().contains("no certificate"),
            "{err}"
        );
        assert!(broken.watch("/api/v1/nodes").is_err());
        let no_ca = ApiConfig {
            tls: Default::default(),
            ..config
        };
        let err = ApiClient::new(&no_ca, watch).err().unwrap();
        assert!(err.to_string().contains("needs a CA"), "{err}");
    }

    #[test]
    fn a_client_certificate_with_another_key_is_refused_not_handed_to_tls() {
        let pair = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec![name.to_string()])
                .unwrap()
                .self_signed(&key)
                .unwrap();
            (cert.pem().into_bytes(), key.serialize_pem().into_bytes())
        };
        let ((cert, key), (_, other_key)) = (pair("node-a"), pair("node-b"));
        let tls = |cert: &[u8], key: &[u8]| super::super::config::Tls {
            ca: Some(cert.to_vec()),
            client_cert: Some(cert.to_vec()),
            client_key: Some(key.to_vec()),
            ..Default::default()
        };
        let server = "https://198.18.0.1";
        assert!(tls_config(server, &tls(&cert, &key)).is_ok());
        for (cert, key, why) in [
            (
                &cert[..],
                &other_key[..],
                "does not belong to the client certificate",
            ),
            (b"no pem here", &key[..], "holds no certificate"),
            (
                &cert[..],
                b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
                "failed to parse private key",
            ),
        ] {
            let err = tls_config(server, &tls(cert, key)).err().unwrap();
            assert!(err.to_string().contains(why), "{err} lacks {why}");
        }
    }
}
