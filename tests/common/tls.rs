//! TLS for the loopback API servers: certificate authorities and the
//! certificates they issue (made in the test, never stored), and a server
//! side that any loopback server wraps its accepted connections with. Its
//! certificate and the authority it trusts for client certificates can be
//! swapped while it runs (a rotation); every handshake it refuses and every
//! client certificate it accepts is told to its caller.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection, StreamOwned};

/// A certificate authority made for one test.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
    pem: String,
}

/// A certificate with its key, as the files a kubeconfig names hold them.
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: Vec<u8>,
    key_der: Vec<u8>,
}

/// How long an issued certificate is valid.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    Now,
    /// Expired long ago.
    Expired,
}

impl Authority {
    pub fn new(name: &str) -> Authority {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).unwrap();
        Authority {
            pem: cert.pem(),
            cert: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA certificate in PEM (what a CA bundle file holds).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A server certificate for 127.0.0.1.
    pub fn server(&self) -> Issued {
        self.issue(vec!["127.0.0.1".into()], "apiserver", Validity::Now, false)
    }

    /// A client certificate for user `name`.
    pub fn client(&self, name: &str, validity: Validity) -> Issued {
        self.issue(Vec::new(), name, validity, true)
    }

    fn issue(&self, names: Vec<String>, cn: &str, validity: Validity, client: bool) -> Issued {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![match client {
            true => ExtendedKeyUsagePurpose::ClientAuth,
            false => ExtendedKeyUsagePurpose::ServerAuth,
        }];
        (params.not_before, params.not_after) = match validity {
            Validity::Now => (
                rcgen::date_time_ymd(2020, 1, 1),
                rcgen::date_time_ymd(4000, 1, 1),
            ),
            Validity::Expired => (
                rcgen::date_time_ymd(2001, 1, 1),
                rcgen::date_time_ymd(2002, 1, 1),
            ),
        };
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        }
    }
}

/// Replaces a credential file as a Secret volume does: the new content
/// appears whole, under a new inode.
pub fn replace_file(path: &std::path::Path, text: &str) {
    let staged = path.with_extension("new");
    std::fs::write(&staged, text).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

/// A connection a loopback server reads a request from and answers on.
pub trait Stream: Read + Write + Send {
    /// Says the answer is complete before the connection is cut (TLS
    /// `close_notify`; nothing in plain TCP).
    fn finish(&mut self) {}
}

impl Stream for TcpStream {}

impl Stream for StreamOwned<ServerConnection, TcpStream> {
    fn finish(&mut self) {
        self.conn.send_close_notify();
        let _ = self.flush();
    }
}

/// The server side of TLS, shared by every connection of one server.
pub struct TlsServer {
    config: Mutex<Arc<ServerConfig>>,
}

/// What a handshake gave.
pub enum Accepted {
    /// TLS is up; `client` is the certificate the client presented (DER).
    Up {
        stream: Box<dyn Stream>,
        client: Option<Vec<u8>>,
    },
    /// The handshake failed (its error in words): nothing more is read.
    Refused(String),
}

impl TlsServer {
    /// A server presenting `cert`; with `clients`, it asks every client
    /// for a certificate of that authority and refuses one without.
    pub fn new(cert: &Issued, clients: Option<&Authority>) -> Arc<TlsServer> {
        Arc::new(TlsServer {
            config: Mutex::new(server_config(cert, clients)),
        })
    }

    /// Rotates: new connections get `cert` and the trust of `clients`.
    pub fn set(&self, cert: &Issued, clients: Option<&Authority>) {
        *self.config.lock().unwrap() = server_config(cert, clients);
    }

    /// Runs the handshake on an accepted connection.
    pub fn accept(&self, tcp: TcpStream) -> Accepted {
        let config = Arc::clone(&self.config.lock().unwrap());
        let mut conn = match ServerConnection::new(config) {
            Ok(conn) => conn,
            Err(err) => return Accepted::Refused(err.to_string()),
        };
        let mut tcp = tcp;
        while conn.is_handshaking() {
            if let Err(err) = conn.complete_io(&mut tcp) {
                return Accepted::Refused(handshake_error(&err));
            }
        }
        let client = conn
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| cert.to_vec());
        Accepted::Up {
            stream: Box::new(StreamOwned::new(conn, tcp)),
            client,
        }
    }
}

fn handshake_error(err: &io::Error) -> String {
    match err.get_ref() {
        Some(inner) => inner.to_string(),
        None => err.to_string(),
    }
}

fn server_config(cert: &Issued, clients: Option<&Authority>) -> Arc<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match clients {
        None => builder.with_no_client_auth(),
        Some(authority) => {
            let mut roots = RootCertStore::empty();
            roots.add(authority.cert.clone()).unwrap();
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
            builder.with_client_cert_verifier(verifier)
        }
    };
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.key_der.clone()));
    let config = builder
        .with_single_cert(vec![CertificateDer::from(cert.der.clone())], key)
        .unwrap();
    Arc::new(config)
}
