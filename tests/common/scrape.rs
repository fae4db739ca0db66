//! A daemon's metrics as a scraper reads them: the listener's address from
//! its log, one HTTP GET, one series' value.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::{TestDaemon, wait_for};

/// The address the daemon's metrics listener bound (from its log).
pub fn metrics_addr(daemon: &TestDaemon) -> String {
    let mut addr = String::new();
    wait_for("the metrics listener", Duration::from_secs(10), || {
        let log = daemon.log();
        match log.lines().find(|l| l.contains("metrics listening")) {
            Some(line) => {
                addr = line.rsplit("addr=").next().unwrap().trim().to_string();
                true
            }
            None => false,
        }
    });
    addr
}

/// One HTTP GET: (status line, body).
pub fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: metis\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The value of one series in a metrics body.
pub fn series(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no series {series} in:\n{body}"))
        .parse()
        .unwrap()
}
