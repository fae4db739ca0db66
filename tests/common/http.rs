//! The HTTP/1.1 the loopback API server (`kube_api.rs`) speaks: reading a
//! request, writing an answer (whole, or a chunked watch and its end), the
//! `Status` failure body and JSON merge patch.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use serde_json::{Value, json};

/// Largest request body accepted: the API server's limit, 3 MiB (its
/// `MaxRequestBodyBytes`), past which it answers 413.
pub const MAX_REQUEST: usize = 3 * 1024 * 1024;

/// A listening server's accept loop: one thread per connection, each
/// given the stop flag it must watch, and a handle on every open
/// connection so that [`Acceptor::cut`] and [`Acceptor::stop`] can end them.
pub struct Acceptor {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    thread: JoinHandle<()>,
}

impl Acceptor {
    /// Accepts on `listener`, serving each connection with `serve`.
    pub fn spawn(
        listener: TcpListener,
        serve: impl Fn(TcpStream, &AtomicBool) + Send + Sync + 'static,
    ) -> Acceptor {
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(HashMap::new()));
        let serve = Arc::new(serve);
        let thread = {
            let (stop, conns) = (Arc::clone(&stop), Arc::clone(&conns));
            thread::spawn(move || {
                let mut next = 0u64;
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(stream) = stream else { continue };
                    let id = next;
                    next += 1;
                    if let Ok(copy) = stream.try_clone() {
                        conns.lock().unwrap().insert(id, copy);
                    }
                    let (stop, conns, serve) =
                        (Arc::clone(&stop), Arc::clone(&conns), Arc::clone(&serve));
                    thread::spawn(move || {
                        serve(stream, &stop);
                        conns.lock().unwrap().remove(&id);
                    });
                }
            })
        };
        Acceptor {
            addr,
            stop,
            conns,
            thread,
        }
    }

    /// Cuts every open connection and keeps listening.
    pub fn cut(&self) {
        for (_, conn) in self.conns.lock().unwrap().drain() {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }

    /// Stops listening and cuts every open connection; `wake` runs between
    /// the two, to wake connection threads blocked on the server's state.
    pub fn stop(self, wake: impl FnOnce()) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut();
        wake();
        // Unblock accept() with a throwaway connection.
        let _ = TcpStream::connect(self.addr);
        let _ = self.thread.join();
    }
}

/// One request as the servers see it.
pub struct Request {
    pub method: String,
    /// The path, percent-decoded.
    pub path: String,
    /// The query as sent (tests assert on what the client asked).
    pub raw_query: String,
    /// The query's pairs, percent-decoded.
    pub query: Vec<(String, String)>,
    /// Lower-cased.
    pub content_type: String,
    /// `Connection: close`.
    pub close: bool,
    /// The bearer token, empty for none.
    pub token: String,
    pub body: Vec<u8>,
}

impl Request {
    /// The first value of a query parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// A request whose `Content-Length` is over the limit: its head, its body
/// left unread (the answer must close the connection).
pub struct TooLarge {
    pub head: Request,
    pub length: usize,
}

/// Reads one request whose body is at most `limit` bytes: `Ok(None)` at
/// the end of the connection or on a request that cannot be read,
/// `Err` for a larger body (unread).
pub fn read_request_within(
    stream: &mut impl BufRead,
    limit: usize,
) -> Result<Option<Request>, Box<TooLarge>> {
    let Some((mut head, length)) = read_head(stream) else {
        return Ok(None);
    };
    if length > limit {
        return Err(Box::new(TooLarge { head, length }));
    }
    let mut body = vec![0; length];
    if stream.read_exact(&mut body).is_err() {
        return Ok(None);
    }
    head.body = body;
    Ok(Some(head))
}

/// The request line and headers: the request without its body, and the
/// body's length.
fn read_head(stream: &mut impl BufRead) -> Option<(Request, usize)> {
    let mut line = String::new();
    if stream.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let target = parts.next()?.to_string();
    let mut length = 0usize;
    let mut content_type = String::new();
    let mut close = false;
    let mut token = String::new();
    loop {
        let mut header = String::new();
        if stream.read_line(&mut header).ok()? == 0 {
            return None;
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let value = value.trim();
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.parse().ok()?,
                "content-type" => content_type = value.to_ascii_lowercase(),
                "connection" => close = value.eq_ignore_ascii_case("close"),
                "authorization" => {
                    token = value.strip_prefix("Bearer ").unwrap_or("").to_string();
                }
                _ => {}
            }
        }
    }
    let (path, raw_query) = target.split_once('?').unwrap_or((&target, ""));
    let query = raw_query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key), percent_decode(value))
        })
        .collect();
    let head = Request {
        method,
        path: percent_decode(path),
        raw_query: raw_query.to_string(),
        query,
        content_type,
        close,
        token,
        body: Vec::new(),
    };
    Some((head, length))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |at: usize| {
            bytes
                .get(at)
                .and_then(|b| char::from(*b).to_digit(16))
                .and_then(|d| u8::try_from(d).ok())
        };
        match (bytes[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(high), Some(low)) => {
                out.push(high << 4 | low);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The status line's reason phrase.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        410 => "Gone",
        413 => "Request Entity Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        500 => "Internal Server Error",
        _ => "Error",
    }
}

/// A whole answer with a JSON body, in one write; `headers` are extra
/// header lines, each ending in CRLF.
pub fn respond(stream: &mut (impl Write + ?Sized), status: u16, text: &str, headers: &str) {
    let reason = reason(status);
    let whole = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{text}",
        text.len()
    );
    let _ = stream.write_all(whole.as_bytes());
}

/// A `Status` failure object, as the API server answers a refused request.
pub fn failure(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// The head of a watch's chunked answer (its connection closes after it).
pub fn start_watch(stream: &mut (impl Write + ?Sized)) -> std::io::Result<()> {
    stream.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
    )
}

/// The end of a chunked watch answer.
pub fn end_watch(stream: &mut (impl Write + ?Sized)) {
    let _ = stream.write_all(b"0\r\n\r\n");
}

/// An `ERROR` event carrying `status`, and the end of the watch.
pub fn end_watch_with_error(stream: &mut (impl Write + ?Sized), status: &Value) {
    let event = json!({"type": "ERROR", "object": status});
    let _ = write_chunk(stream, &format!("{event}\n"));
    end_watch(stream);
}

/// One chunk of a chunked watch response, flushed.
pub fn write_chunk(stream: &mut (impl Write + ?Sized), text: &str) -> std::io::Result<()> {
    write!(stream, "{:x}\r\n{text}\r\n", text.len())?;
    stream.flush()
}

/// RFC 7386 JSON merge patch: `null` removes a field, objects merge,
/// anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    for (key, value) in fields {
        if value.is_null() {
            if let Some(object) = target.as_object_mut() {
                object.remove(key);
            }
        } else {
            merge_patch(&mut target[key.as_str()], value);
        }
    }
}

/// Listens again on the address a stopped server used, waiting (up to
/// 10 s) for the kernel to let go of it.
pub fn rebind(addr: SocketAddr) -> TcpListener {
    super::poll(Duration::from_secs(10), || TcpListener::bind(addr).ok())
        .unwrap_or_else(|| panic!("cannot rebind {addr}: {:?}", TcpListener::bind(addr).err()))
}
