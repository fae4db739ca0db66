//! Rotated credentials through real TLS handshakes (issue 24, item 7): the
//! daemon in NNC mode follows an HTTPS loopback API server through a
//! kubeconfig naming certificate-authority, client-certificate, client-key
//! and token *files*. The server's certificate moves to a new CA and the
//! CA file is rewritten; the client certificate and key are rotated and the
//! server accepts only the new one; a wrong CA, an expired client
//! certificate and a key of another certificate are refused loudly, write
//! nothing, and the daemon recovers once the files are fixed — never a
//! restart.

// The edge build (no `kube` feature) has no Kubernetes side to test.
#![cfg(feature = "kube")]

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::cloud::{Cloud, NodeView};
use common::cluster::{default_conf, health_detail, start_daemon_as};
use common::kube_api::State;
use common::scrape::{http_get, metrics_addr, series};
use common::tls::{Authority, Issued, TlsServer, Validity, replace_file};
use common::{TestDaemon, TestDir, wait_for};

const WAIT: Duration = Duration::from_secs(30);
/// Fast retries: each refused attempt is followed by a short backoff.
const FLAGS: &[&str] = &[
    "--api-max-backoff",
    "200ms",
    "--metrics-addr",
    "127.0.0.1:0",
];

/// The credential files a kubeconfig names.
struct Files {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    token: PathBuf,
}

impl Files {
    fn new(dir: &TestDir) -> Files {
        Files {
            ca: dir.join("ca.crt"),
            cert: dir.join("client.crt"),
            key: dir.join("client.key"),
            token: dir.join("token"),
        }
    }

    /// The kubeconfig user: a token file and, with `certificate`, a client
    /// certificate and key.
    fn user(&self, certificate: bool) -> String {
        let mut user = format!("    tokenFile: {}", self.token.display());
        if certificate {
            user.push_str(&format!(
                "\n    client-certificate: {}\n    client-key: {}",
                self.cert.display(),
                self.key.display()
            ));
        }
        user
    }

    /// Rotates the client certificate: the key first, then the certificate
    /// (between the two, the files do not match).
    fn client(&self, issued: &Issued) {
        replace_file(&self.key, &issued.key_pem);
        replace_file(&self.cert, &issued.cert_pem);
    }
}

/// Requests the server answered (refused handshakes are not requests).
fn answered(api: &Cloud) -> usize {
    api.state().log.len()
}

fn api_errors(daemon: &TestDaemon) -> f64 {
    let (_, body) = http_get(&metrics_addr(daemon), "/metrics");
    series(&body, "metis_daemon_api_server_errors_total")
}

/// Waits until health is degraded with `why` in it.
fn wait_degraded(daemon: &TestDaemon, why: &str) -> String {
    let mut detail = String::new();
    wait_for(&format!("health to say {why:?}"), WAIT, || {
        detail = health_detail(daemon);
        detail.contains("degraded") && detail.contains(why)
    });
    detail
}

/// The watch's problem in a health detail ("watch: …" up to the next
/// problem), empty when it names none.
fn watch_part(detail: &str) -> &str {
    detail
        .split_once("watch: ")
        .and_then(|(_, rest)| rest.split(';').next())
        .unwrap_or("")
}

/// Waits until the cluster link is healthy again (a watch is open).
fn wait_healthy(daemon: &TestDaemon) {
    wait_for("health to be clean", WAIT, || {
        !health_detail(daemon).contains("degraded")
    });
}

/// ADDs that outgrow what the node has make it patch its spec; returns the
/// pods the spec asks for once it asks for at least `pods`.
fn grow(api: &Cloud, config: &str, ids: std::ops::Range<usize>) -> i64 {
    let want = i64::try_from(ids.end).unwrap();
    let addresses = common::add_concurrently(config, ids.clone());
    assert_eq!(addresses.len(), ids.len());
    api.wait_until("the spec to ask for the pods", WAIT, |s| {
        s.pods("default").is_some_and(|p| p >= want)
    });
    api.state().pods("default").unwrap()
}

/// A pod count the current request does not cover (the request includes
/// the headroom the blocks granted so far hold): growing to it needs a
/// PATCH.
fn beyond_the_request(api: &Cloud) -> usize {
    let asked = api.state().pods("default").unwrap_or(0);
    usize::try_from(asked).unwrap() + 1
}

fn patches_ok(state: &State) -> usize {
    state.answered("PATCH", 200)
}

#[test]
fn a_server_moved_to_a_new_ca_is_followed_once_the_ca_file_is_rewritten() {
    let dir = TestDir::new("tls-ca");
    let files = Files::new(&dir);
    let old_ca = Authority::new("old");
    std::fs::write(&files.ca, old_ca.pem()).unwrap();
    std::fs::write(&files.token, "first-token").unwrap();
    let tls = TlsServer::new(&old_ca.server(), None);
    let api = Cloud::start_tls(&[], tls, &files.ca);
    let daemon = start_daemon_as(&dir, &api, "nnc", &files.user(false), FLAGS);
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    assert!(grow(&api, &config, 0..20) >= 20);
    assert_eq!(api.state().tokens(), ["first-token"]);

    // The API server restarts with a certificate of a new CA; the node
    // still trusts the old one: refused, loudly, nothing sent.
    let new_ca = Authority::new("new");
    api.tls().set(&new_ca.server(), None);
    let errors = api_errors(&daemon);
    api.cut_connections();
    // (A request sent before may still be answered: count from the first
    // refused handshake on.)
    api.wait_until("a refused handshake", WAIT, |s| !s.tls_refused.is_empty());
    let before = answered(&api);
    // Each of the node's requests is refused once it is tried: a patch may
    // be refused (and reported) before the watch's next attempt is.
    wait_degraded(&daemon, "UnknownIssuer");
    wait_for("health to name the watch's refusal", WAIT, || {
        watch_part(&health_detail(&daemon)).contains("UnknownIssuer")
    });
    assert!(api_errors(&daemon) > errors);
    assert!(daemon.log().contains("API watch failed"));
    assert_eq!(answered(&api), before, "{:?}", api.state().log);

    // The CA file (and the token) are rotated on disk: the next attempt
    // uses them, no restart, and the node grows again through patches.
    replace_file(&files.ca, new_ca.pem());
    replace_file(&files.token, "second-token");
    wait_healthy(&daemon);
    let patched = patches_ok(&api.state());
    let more = beyond_the_request(&api);
    assert!(grow(&api, &config, 20..more) >= i64::try_from(more).unwrap());
    assert!(patches_ok(&api.state()) > patched);
    assert_eq!(api.state().tokens().last().unwrap(), "second-token");
    assert!(daemon.log().contains("TLS material changed on disk"));
}

#[test]
fn a_rotated_client_certificate_is_presented_and_the_old_one_no_longer_is() {
    let dir = TestDir::new("tls-client");
    let files = Files::new(&dir);
    let ca = Authority::new("cluster");
    let (first_users, second_users) = (Authority::new("users-1"), Authority::new("users-2"));
    let (first, second) = (
        first_users.client("node", Validity::Now),
        second_users.client("node", Validity::Now),
    );
    std::fs::write(&files.ca, ca.pem()).unwrap();
    std::fs::write(&files.token, "token").unwrap();
    files.client(&first);
    let server_cert = ca.server();
    let tls = TlsServer::new(&server_cert, Some(&first_users));
    let api = Cloud::start_tls(&[], tls, &files.ca);
    let daemon = start_daemon_as(&dir, &api, "nnc", &files.user(true), FLAGS);
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    assert!(grow(&api, &config, 0..20) >= 20);
    assert_eq!(api.state().client_certs, std::slice::from_ref(&first.der));

    // The cluster trusts only the new users' CA from now on: the old
    // certificate is refused at the handshake.
    api.tls().set(&server_cert, Some(&second_users));
    api.cut_connections();
    api.wait_until("a refused handshake", WAIT, |s| !s.tls_refused.is_empty());
    let before = answered(&api);
    wait_degraded(&daemon, "watch:");
    assert_eq!(answered(&api), before);

    // The node's certificate and key are rotated: it presents the new one.
    files.client(&second);
    api.wait_until("the new client certificate", WAIT, |s| {
        s.client_certs.last() == Some(&second.der)
    });
    wait_healthy(&daemon);
    let patched = patches_ok(&api.state());
    let more = beyond_the_request(&api);
    assert!(grow(&api, &config, 20..more) >= i64::try_from(more).unwrap());
    let state = api.state();
    assert!(patches_ok(&state) > patched);
    assert_eq!(state.client_certs, [first.der.clone(), second.der.clone()]);
}

#[test]
fn bad_credentials_are_refused_loudly_write_nothing_and_recover_when_fixed() {
    let dir = TestDir::new("tls-bad");
    let files = Files::new(&dir);
    let ca = Authority::new("cluster");
    let users = Authority::new("users");
    let good = users.client("node", Validity::Now);
    std::fs::write(&files.ca, Authority::new("someone else").pem()).unwrap();
    std::fs::write(&files.token, "token").unwrap();
    files.client(&good);
    let tls = TlsServer::new(&ca.server(), Some(&users));
    let api = Cloud::start_tls(&[], tls, &files.ca);
    let daemon = start_daemon_as(&dir, &api, "nnc", &files.user(true), FLAGS);

    // A CA that did not sign the server's certificate.
    wait_degraded(&daemon, "UnknownIssuer");
    assert!(api_errors(&daemon) >= 1.0);
    assert_eq!(answered(&api), 0, "{:?}", api.state().log);
    assert!(api.state().nnc().is_none());
    replace_file(&files.ca, ca.pem());
    api.wait_until("the NodeNetworkConfig", WAIT, |s| s.nnc().is_some());
    wait_healthy(&daemon);
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    grow(&api, &config, 0..20);

    // An expired client certificate: the server refuses it.
    // (A request sent before the rotation may still be answered: count
    // from the first refusal on.)
    files.client(&users.client("node", Validity::Expired));
    let refused = api.state().tls_refused.len();
    api.cut_connections();
    api.wait_until("the expired certificate refused", WAIT, |s| {
        s.tls_refused[refused..]
            .iter()
            .any(|why| why.contains("expired") || why.contains("Expired"))
    });
    // The node may still have raised its demand before that (its spec
    // settles after the grow): read both at once.
    let (before, pods) = {
        let state = api.state();
        (state.log.len(), state.pods("default"))
    };
    wait_degraded(&daemon, "watch:");
    assert_eq!(answered(&api), before);

    // A certificate with the key of another: refused before any handshake,
    // and the daemon goes on (no panic in the TLS stack).
    let other = users.client("other", Validity::Now);
    replace_file(&files.key, &other.key_pem);
    replace_file(&files.cert, &good.cert_pem);
    wait_degraded(
        &daemon,
        "the client key does not belong to the client certificate",
    );
    let handshakes = |api: &Cloud| {
        let state = api.state();
        state.tls_refused.len() + state.client_certs.len()
    };
    let before_pair = handshakes(&api);
    let errors = api_errors(&daemon);
    wait_for("the daemon to retry and refuse again", WAIT, || {
        api_errors(&daemon) > errors
    });
    assert_eq!(
        handshakes(&api),
        before_pair,
        "a mismatched pair must not reach the server"
    );
    assert_eq!(answered(&api), before);
    assert_eq!(api.state().pods("default"), pods);

    // Fixed: the good pair again; the node follows and grows.
    replace_file(&files.key, &good.key_pem);
    wait_healthy(&daemon);
    assert!(grow(&api, &config, 20..40) >= 40);
    assert_eq!(api.state().client_certs.last(), Some(&good.der));
}
