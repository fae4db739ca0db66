//! Prometheus metrics scraped over real HTTP after known operations.

use crate::common;

use common::scrape::{http_get as get, metrics_addr, series as value};
use common::{Plugin, TestDaemon, TestDir, assert_ok, conf};

#[test]
fn scrape_reflects_known_operations() {
    let dir = TestDir::new("metrics");
    let daemon = TestDaemon::start(&dir, &["--metrics-addr", "127.0.0.1:0"]);
    let addr = metrics_addr(&daemon);
    let config = conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/24"}]]"#, "");
    assert_ok(&Plugin::new("ADD", "m1").run(&config));
    assert_ok(&Plugin::new("ADD", "m2").run(&config));
    assert_ok(&Plugin::new("DEL", "m1").run(&config));
    let full =
        conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.1.0/30"}]]"#, "").replace("testnet", "tiny");
    assert_ok(&Plugin::new("ADD", "t1").run(&full));
    let exhausted = Plugin::new("ADD", "t2").run(&full);
    assert_eq!(exhausted.status.code(), Some(1));

    let (status, body) = get(&addr, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let ip = |network: &str, kind: &str| {
        value(
            &body,
            &format!(
                "metis_local_store_ip_total{{network=\"{network}\",ip_family=\"ipv4\",type=\"{kind}\"}}"
            ),
        )
    };
    // /24: 3 reserved + m2 allocated; m1 cooling (1 m default cooldown).
    assert_eq!(ip("testnet", "allocated"), 4.0);
    assert_eq!(ip("testnet", "cooldown"), 1.0);
    assert_eq!(ip("testnet", "total"), 256.0);
    assert_eq!(ip("testnet", "available"), 251.0);
    assert_eq!(ip("tiny", "available"), 0.0);
    assert_eq!(
        value(
            &body,
            "metis_local_store_cidr_block_total{network=\"testnet\",ip_family=\"ipv4\",status=\"ready\"}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &body,
            "metis_daemon_requests_handled_total{method=\"allocate\",status=\"OK\"}"
        ),
        3.0
    );
    assert_eq!(
        value(
            &body,
            "metis_daemon_requests_handled_total{method=\"deallocate\",status=\"OK\"}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &body,
            "metis_daemon_requests_handled_total{method=\"allocate\",status=\"RESOURCE_EXHAUSTED\"}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &body,
            "metis_daemon_request_latency_seconds_count{method=\"allocate\"}"
        ),
        4.0
    );
    assert_eq!(value(&body, "metis_build_info{version=\"0.1.0\"}"), 1.0);
    assert!(!body.contains("container_id"), "no per-pod labels");

    let (status, body) = get(&addr, "/healthz");
    assert_eq!(
        (status.as_str(), body.as_str()),
        ("HTTP/1.1 200 OK", "ok\n")
    );
    let (status, _) = get(&addr, "/nope");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
}

#[test]
fn bad_metrics_address_is_a_usage_error() {
    let output = common::metis(&["daemon", "--metrics-addr", "localhost"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--metrics-addr"));
}
