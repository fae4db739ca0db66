//! The plugin's run flow: read the environment and stdin, do the verb, print
//! exactly one JSON document (result or error) on stdout. Logs go to the
//! configured log file, never to stdout.

use std::fs;
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use crate::cidr::{Cidr, Family};
use crate::cni::args::{self, CniArgs};
use crate::cni::backend::{Backend, Node};
use crate::cni::conf::{self, NetConf};
use crate::cni::dns::{Dns, MAX_RESOLV_CONF_BYTES};
use crate::cni::env::{self, CniEnv, Verb};
use crate::cni::error::CniError;
use crate::cni::result::{self, AllocatedIp};
use crate::cni::version;
use crate::engine::request::{Add, Check, Command, Del, FamilyAdd, Gc, Pod, StatusQuery};
use crate::log;
use crate::names::Attachment;
use crate::store::InForce;
use crate::wire::{client, ipam, response};

/// Largest network configuration accepted on stdin.
const MAX_STDIN: usize = 1024 * 1024;

/// The text printed when the binary runs without `CNI_COMMAND`.
pub fn about() -> String {
    format!(
        "Metis CNI plugin {}\nCNI protocol versions supported: {}",
        env!("CARGO_PKG_VERSION"),
        version::SUPPORTED.join(", ")
    )
}

/// Entry point used by `main`: real environment, stdin and stdout.
pub fn main() -> u8 {
    // Until the config names a log file there is nowhere to log: stdout is
    // for the CNI JSON and runtimes treat stderr noise as failure output.
    log::init(Box::new(io::sink()), 0);
    let stdin = io::stdin();
    let stdout = io::stdout();
    let stderr = io::stderr();
    run(
        &|name| std::env::var(name).ok(),
        &mut stdin.lock(),
        &mut stdout.lock(),
        &mut stderr.lock(),
        |net_conf| Node::new(&net_conf.daemon_socket, &net_conf.db_path),
    )
}

/// Runs one CNI invocation against the backend `backend_for` makes from the
/// network configuration, and returns the exit code. An empty `CNI_COMMAND`
/// gets the "about" text on stderr and success, as skel does.
pub fn run<B: Backend>(
    lookup: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
    backend_for: impl FnOnce(&NetConf) -> B,
) -> u8 {
    let (output, code) = match execute(lookup, stdin, backend_for) {
        Ok(Reply::About) => {
            let _ = writeln!(stderr, "{}", about());
            return 0;
        }
        Ok(Reply::Stdout(output)) => (output, 0),
        Err((err, cni_version)) => {
            log::error(
                "cni",
                "command failed",
                &[("code", &err.code), ("error", &err)],
            );
            (Some(err.to_json(&cni_version)), 1)
        }
    };
    if let Some(mut text) = output {
        // One write(2): the document and its newline together.
        text.push('\n');
        let written = stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.flush());
        if written.is_err() {
            return 1;
        }
    }
    code
}

/// What a successful invocation prints.
enum Reply {
    /// This JSON document (if any) on stdout.
    Stdout(Option<String>),
    /// No command: the "about" text on stderr.
    About,
}

/// Does the verb; on failure returns the error with the version to print it in.
fn execute<B: Backend>(
    lookup: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
    backend_for: impl FnOnce(&NetConf) -> B,
) -> Result<Reply, (CniError, String)> {
    let no_version = |err: CniError| (err, String::new());
    let Some(cni_env) = env::from_lookup(lookup).map_err(no_version)? else {
        return Ok(Reply::About);
    };
    let input = read_stdin(stdin).map_err(no_version)?;
    if cni_env.verb == Verb::Version {
        return Ok(Reply::Stdout(Some(version::version_reply(&input))));
    }
    let net_conf = conf::parse(&input).map_err(no_version)?;
    let with_version = |err: CniError| (err, net_conf.cni_version.as_str().to_string());
    open_log(&net_conf.log_file, &cni_env);
    log::info(
        "cni",
        "request",
        &[
            ("verb", &cni_env.verb.as_str()),
            ("container_id", &cni_env.container_id),
            ("ifname", &cni_env.ifname),
            ("network", &net_conf.network),
        ],
    );
    let cni_args = args::parse(&cni_env.args).map_err(with_version)?;
    let backend = &mut backend_for(&net_conf);
    // `env` checked the attachment of every verb that requires one.
    let owner = || {
        cni_env.attachment.as_ref().ok_or_else(|| {
            CniError::invalid_env("CNI_CONTAINERID and CNI_IFNAME are required".to_string())
        })
    };
    let outcome = match cni_env.verb {
        Verb::Add => owner()
            .and_then(|owner| add(backend, &net_conf, owner, &cni_env, &cni_args))
            .map(Some),
        Verb::Del => owner()
            .and_then(|owner| del(backend, &net_conf, owner, &cni_args))
            .map(|()| None),
        Verb::Check => owner()
            .and_then(|owner| check(backend, &net_conf, owner))
            .map(|()| None),
        Verb::Status => status(backend, &net_conf).map(|()| None),
        Verb::Gc => gc(backend, &net_conf).map(|()| None),
        Verb::Version => Ok(Some(version::version_reply(&input))),
    };
    outcome.map(Reply::Stdout).map_err(with_version)
}

fn read_stdin(stdin: &mut dyn Read) -> Result<Vec<u8>, CniError> {
    let mut input = Vec::new();
    let limit = u64::try_from(MAX_STDIN + 1).unwrap_or(u64::MAX);
    stdin.take(limit).read_to_end(&mut input).map_err(|err| {
        CniError::io(format!(
            "failed to read network configuration from stdin: {err}"
        ))
    })?;
    if input.len() > MAX_STDIN {
        return Err(CniError::decode(format!(
            "network configuration exceeds {MAX_STDIN} bytes"
        )));
    }
    Ok(input)
}

/// Appends to the plugin's log file, rotating it at
/// [`log::MAX_LOG_FILE_BYTES`]; logging never fails the command. A missing
/// directory is created 0700 (it is often the database's). STATUS, which
/// must create nothing, only appends to a log file that already exists.
fn open_log(path: &Path, cni_env: &CniEnv) {
    // Every line of this invocation names its verb and container.
    log::set_context(&[
        ("verb", &cni_env.verb.as_str()),
        ("container_id", &cni_env.container_id),
    ]);
    let file = if cni_env.verb == Verb::Status {
        fs::OpenOptions::new().append(true).open(path)
    } else {
        open_log_creating_dir(path)
    };
    if let Ok(file) = file {
        log::init(Box::new(file), 0);
        log::debug(
            "cni",
            "environment",
            &[("args", &cni_env.args), ("netns", &cni_env.netns)],
        );
    } else {
        log::init(Box::new(io::sink()), 0);
    }
}

/// The log file opened for appending; its directory is made only when the
/// open finds it missing, so the usual call (directory there) costs one open.
fn open_log_creating_dir(path: &Path) -> io::Result<fs::File> {
    let open = || log::open_rotating(path, log::MAX_LOG_FILE_BYTES, 0o644);
    match open() {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)?;
            }
            open()
        }
        opened => opened,
    }
}

fn add(
    backend: &mut dyn Backend,
    net_conf: &NetConf,
    owner: &Attachment,
    cni_env: &CniEnv,
    cni_args: &CniArgs,
) -> Result<String, CniError> {
    net_conf.require_ranges()?;
    let requested = net_conf.requested_addresses(cni_args)?;
    let dns = match &net_conf.resolv_conf {
        None => Dns::default(),
        Some(path) => Dns::parse(&read_resolv_conf(path)?),
    };
    let request = Command::Add(Box::new(Add {
        network: net_conf.network.clone(),
        pod: pod(cni_args),
        ipv4: family_add(net_conf, Family::V4, owner, &requested),
        ipv6: family_add(net_conf, Family::V6, owner, &requested),
        isolated: net_conf.isolated,
        conf_name: net_conf.name.clone(),
    }));
    let Some(response::Kind::Allocate(allocated)) = send(backend, request)? else {
        return Err(CniError::unexpected_response("allocate"));
    };
    let ips = [allocated.ipv4, allocated.ipv6]
        .into_iter()
        .flatten()
        .map(|pod_ip| allocated_ip(&pod_ip))
        .collect::<Result<Vec<_>, _>>()?;
    for ip in &ips {
        log::info(
            "cni",
            "allocated",
            &[
                ("container_id", &cni_env.container_id),
                ("address", &ip.address),
                ("block", &ip.block),
            ],
        );
    }
    Ok(result::success(
        net_conf,
        &cni_env.netns,
        &cni_env.ifname,
        &ips,
        &dns,
    ))
}

/// The allocation request's part for one family: the configuration's
/// ranges of that family with their host-local bounds, and the address of
/// that family among `requested`, if any. `None` without ranges of it.
pub fn family_add(
    net_conf: &NetConf,
    family: Family,
    owner: &Attachment,
    requested: &[IpAddr],
) -> Option<FamilyAdd> {
    let ranges = in_force(net_conf, family);
    (!ranges.ranges.is_empty()).then(|| FamilyAdd {
        owner: owner.clone(),
        ranges,
        requested: requested
            .iter()
            .copied()
            .find(|ip| Family::of(*ip) == family),
    })
}

/// The configuration's `family` ranges with the host-local bounds of those
/// that have them.
fn in_force(net_conf: &NetConf, family: Family) -> InForce {
    let ranges = match family {
        Family::V4 => &net_conf.ipv4_ranges,
        Family::V6 => &net_conf.ipv6_ranges,
    };
    InForce {
        ranges: ranges.clone(),
        bounds: net_conf
            .bounds
            .iter()
            .filter(|(subnet, _)| subnet.family() == family)
            .cloned()
            .collect(),
    }
}

fn pod(cni_args: &CniArgs) -> Pod {
    Pod {
        namespace: cni_args.pod_namespace.clone(),
        name: cni_args.pod_name.clone(),
    }
}

/// Reads `ipam.resolvConf`, at most [`MAX_RESOLV_CONF_BYTES`], before
/// anything is allocated (as host-local does): a failure fails the ADD
/// with code 5 and holds nothing.
fn read_resolv_conf(path: &std::path::Path) -> Result<String, CniError> {
    use std::io::Read;
    let failed = |err: &dyn std::fmt::Display| {
        CniError::io(format!(
            "failed to read ipam.resolvConf {}: {err}",
            path.display()
        ))
    };
    let file = std::fs::File::open(path).map_err(|e| failed(&e))?;
    let mut bytes = Vec::new();
    file.take(MAX_RESOLV_CONF_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| failed(&e))?;
    if bytes.len() as u64 > MAX_RESOLV_CONF_BYTES {
        return Err(failed(&format!(
            "larger than {MAX_RESOLV_CONF_BYTES} bytes"
        )));
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn del(
    backend: &mut dyn Backend,
    net_conf: &NetConf,
    owner: &Attachment,
    cni_args: &CniArgs,
) -> Result<(), CniError> {
    let request = Command::Del(Del {
        network: net_conf.network.clone(),
        owner: owner.clone(),
        pod: pod(cni_args),
    });
    send(backend, request).map(|_| ())
}

fn check(
    backend: &mut dyn Backend,
    net_conf: &NetConf,
    owner: &Attachment,
) -> Result<(), CniError> {
    if !net_conf.cni_version.has_check() {
        return Err(CniError::incompatible_version(format!(
            "config version {} does not allow CHECK",
            net_conf.cni_version.as_str()
        )));
    }
    let request = Command::Check(Check {
        network: net_conf.network.clone(),
        owner: owner.clone(),
    });
    let Some(response::Kind::Check(checked)) = send(backend, request)? else {
        return Err(CniError::unexpected_response("check"));
    };
    let listed = net_conf.prev_result_ips()?;
    if net_conf.prev_result.is_none() {
        return Ok(());
    }
    // The spec lets later plugins in the chain add addresses and
    // interfaces: only Metis's own addresses must be there. Prefixes are
    // not compared: a block's prefix changes when its ranges are narrowed
    // or retired while the address stays held.
    let mut missing = Vec::new();
    for pod_ip in &checked.allocated {
        let held = allocated_ip(pod_ip)?.address;
        if !listed.contains(&held) {
            missing.push(held.to_string());
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CniError::allocation_differs(format!(
            "prevResult does not list the allocation's {}",
            missing.join(", ")
        )))
    }
}

/// STATUS: 0 when an ADD could be served now, else code 50 with the reason.
/// One read-only round trip (or read-only direct mode), so kubelet's
/// 5-second poll costs nothing and never creates a database.
fn status(backend: &mut dyn Backend, net_conf: &NetConf) -> Result<(), CniError> {
    require_gc_and_status(net_conf, "STATUS")?;
    net_conf.require_ranges()?;
    let request = Command::Status(StatusQuery {
        network: net_conf.network.clone(),
        isolated: net_conf.isolated,
        ipv4: in_force(net_conf, Family::V4),
        ipv6: in_force(net_conf, Family::V6),
    });
    let unavailable = |err: CniError| CniError::plugin_not_available(err.to_string());
    let Some(response) = backend.call_read_only(request).map_err(unavailable)? else {
        return Ok(());
    };
    let kind = client::accepted(response, |refused| {
        unavailable(CniError::from_status(refused.status.as_ref()))
    })?;
    match kind {
        Some(response::Kind::NetworkStatus(status)) if status.can_allocate => Ok(()),
        Some(response::Kind::NetworkStatus(status)) => {
            Err(CniError::plugin_not_available(status.detail))
        }
        _ => Err(unavailable(CniError::unexpected_response("status"))),
    }
}

/// GC: releases this network's allocations that are not among the valid
/// attachments (none valid when the key is absent, as libcni sends it) and
/// older than `ipam.gcGracePeriod`. Prints nothing on success.
fn gc(backend: &mut dyn Backend, net_conf: &NetConf) -> Result<(), CniError> {
    require_gc_and_status(net_conf, "GC")?;
    let valid = net_conf
        .valid_attachments
        .iter()
        .flatten()
        .map(|a| (a.container_id.clone(), a.ifname.clone()))
        .collect();
    let request = Command::Gc(Gc {
        network: net_conf.network.clone(),
        conf_name: net_conf.name.clone(),
        valid,
        grace_ms: net_conf.gc_grace_period_ms,
    });
    let Some(response::Kind::Gc(collected)) = send(backend, request)? else {
        return Err(CniError::unexpected_response("gc"));
    };
    for pod_ip in &collected.released {
        log::info(
            "cni",
            "GC released",
            &[
                ("network", &net_conf.network),
                ("address", &pod_ip.ip_address),
            ],
        );
    }
    Ok(())
}

fn require_gc_and_status(net_conf: &NetConf, verb: &str) -> Result<(), CniError> {
    if net_conf.cni_version.has_gc_and_status() {
        return Ok(());
    }
    Err(CniError::incompatible_version(format!(
        "config version {} does not allow {verb}",
        net_conf.cni_version.as_str()
    )))
}

/// Sends a request; the payload of an OK answer, else the CNI error its
/// status maps to.
fn send(backend: &mut dyn Backend, command: Command) -> Result<Option<response::Kind>, CniError> {
    let response = backend.call(command)?;
    client::accepted(response, |refused| {
        CniError::from_status(refused.status.as_ref())
    })
}

fn allocated_ip(pod_ip: &ipam::PodIp) -> Result<AllocatedIp, CniError> {
    let address: IpAddr = pod_ip
        .ip_address
        .parse()
        .map_err(|_| CniError::unexpected_response("allocate"))?;
    let block: Cidr = pod_ip
        .cidr
        .parse()
        .map_err(|_| CniError::unexpected_response("allocate"))?;
    let gateway = match pod_ip.gateway.as_str() {
        "" => None,
        text => Some(
            text.parse()
                .map_err(|_| CniError::unexpected_response("allocate"))?,
        ),
    };
    Ok(AllocatedIp {
        address,
        block,
        gateway,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::to_wire;
    use crate::testutil::TempDir;
    use crate::wire::envelope::v1 as envelope;
    use crate::wire::{Code, Request, Response, reason, request};
    use serde_json::json;

    /// Answers from a script and keeps what the plugin sent.
    struct Fake<'a> {
        replies: Vec<Result<Response, CniError>>,
        sent: &'a mut Vec<Request>,
    }

    impl Backend for Fake<'_> {
        /// Keeps what the daemon would have received.
        fn call(&mut self, command: Command) -> Result<Response, CniError> {
            self.sent.push(to_wire(&command));
            self.replies.remove(0)
        }

        fn call_read_only(&mut self, command: Command) -> Result<Option<Response>, CniError> {
            self.call(command).map(Some)
        }
    }

    /// One invocation's exit code and stdout, and the requests it sent.
    struct Invocation {
        code: u8,
        stdout: String,
        sent: Vec<Request>,
    }

    impl Invocation {
        fn json(&self) -> serde_json::Value {
            serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {}", self.stdout))
        }
    }

    /// Runs `verb` for container `ctr-1` with `CNI_ARGS` `cni_args` on a
    /// dual-stack 1.1.0 config (plus `extra` top-level keys) against `replies`.
    fn invoke(
        verb: &str,
        cni_args: &str,
        extra: &str,
        replies: Vec<Result<Response, CniError>>,
    ) -> Invocation {
        let dir = TempDir::new();
        let config = format!(
            r#"{{"cniVersion":"1.1.0","name":"testnet","type":"metis","ipam":{{"type":"metis",
                "ranges":[[{{"subnet":"198.18.0.0/24"}}],[{{"subnet":"2001:db8::/120"}}]],
                "routes":[{{"dst":"0.0.0.0/0"}}],"logFile":"{}"}}{extra}}}"#,
            dir.0.join("cni.log").display()
        );
        let env = [
            ("CNI_COMMAND", verb),
            ("CNI_CONTAINERID", "ctr-1"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", cni_args),
            ("CNI_PATH", "/opt/cni/bin"),
        ];
        let lookup = |name: &str| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| value.to_string())
        };
        let (mut stdout, mut stderr, mut sent) = (Vec::new(), Vec::new(), Vec::new());
        let code = run(
            &lookup,
            &mut config.as_bytes(),
            &mut stdout,
            &mut stderr,
            |_| Fake {
                replies,
                sent: &mut sent,
            },
        );
        Invocation {
            code,
            stdout: String::from_utf8(stdout).unwrap(),
            sent,
        }
    }

    fn pod_ip(address: &str, block: &str) -> ipam::PodIp {
        ipam::PodIp {
            ip_address: address.into(),
            cidr: block.into(),
            gateway: String::new(),
        }
    }

    fn exhausted() -> Response {
        Response::error(
            Code::ResourceExhausted,
            reason::IP_POOL_EXHAUSTED,
            "no free address in network testnet",
        )
    }

    #[test]
    fn add_sends_the_attachment_and_prints_the_result() {
        let reply = Response::ok(response::Kind::Allocate(ipam::AllocatePodIpResponse {
            ipv4: Some(pod_ip("198.18.0.9", "198.18.0.0/26")),
            ipv6: Some(pod_ip("2001:db8::9", "2001:db8::/120")),
        }));
        let add = invoke(
            "ADD",
            "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod;IP=198.18.0.9",
            "",
            vec![Ok(reply)],
        );
        assert_eq!(add.code, 0, "{}", add.stdout);
        let config = |cidr: &str, requested: &str| ipam::IpConfig {
            interface_name: "eth0".into(),
            container_id: "ctr-1".into(),
            initial_pod_cidr: cidr.into(),
            additional_pod_cidrs: Vec::new(),
            requested_ip: requested.into(),
            bounds: Vec::new(),
        };
        let want = request::Kind::Allocate(ipam::AllocatePodIpRequest {
            network: "testnet".into(),
            ipv4_config: Some(config("198.18.0.0/24", "198.18.0.9")),
            ipv6_config: Some(config("2001:db8::/120", "")),
            pod_name: "pod".into(),
            pod_namespace: "ns".into(),
            isolated: false,
            conf_name: "testnet".into(),
        });
        assert_eq!(add.sent, [Request { kind: Some(want) }]);
        assert_eq!(
            add.json(),
            json!({
                "cniVersion": "1.1.0",
                "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
                "ips": [
                    {"interface": 0, "address": "198.18.0.9/26", "gateway": "198.18.0.1"},
                    {"interface": 0, "address": "2001:db8::9/120", "gateway": "2001:db8::1"}
                ],
                "routes": [{"dst": "0.0.0.0/0", "gw": "198.18.0.1"}]
            })
        );
    }

    #[test]
    fn failures_become_cni_error_codes() {
        let daemon_down = CniError::try_again_later("no response from the metis daemon");
        let mismatch = Response::ok(response::Kind::Check(ipam::CheckPodIpResponse {
            allocated: vec![pod_ip("198.18.0.2", "198.18.0.0/24")],
        }));
        let prev = r#","prevResult":{"cniVersion":"1.1.0","ips":[{"address":"198.18.0.9/24"}]}"#;
        let cannot_allocate = Response::ok(response::Kind::NetworkStatus(
            envelope::NetworkStatusResponse {
                can_allocate: false,
                detail: "IPv4 pool exhausted".into(),
                ..Default::default()
            },
        ));
        for (verb, extra, reply, code, msg) in [
            ("ADD", "", Ok(exhausted()), 11, "IP address pool exhausted"),
            (
                "ADD",
                "",
                Err(daemon_down),
                11,
                "no response from the metis daemon",
            ),
            ("CHECK", prev, Ok(mismatch), 102, ""),
            ("STATUS", "", Ok(cannot_allocate), 50, "IPv4 pool exhausted"),
            ("STATUS", "", Ok(exhausted()), 50, ""),
        ] {
            let failed = invoke(verb, "", extra, vec![reply]);
            assert_eq!(failed.code, 1, "{verb}: {}", failed.stdout);
            let error = failed.json();
            assert_eq!(error["code"], code, "{verb}: {error}");
            assert_eq!(error["cniVersion"], "1.1.0", "{verb}: {error}");
            if !msg.is_empty() {
                assert_eq!(error["msg"], msg, "{verb}: {error}");
            }
        }
    }

    #[test]
    fn del_of_an_unknown_container_succeeds_silently() {
        let nothing = Response::ok(response::Kind::Deallocate(
            ipam::DeallocatePodIpResponse::default(),
        ));
        let del = invoke(
            "DEL",
            "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod",
            "",
            vec![Ok(nothing)],
        );
        assert_eq!((del.code, del.stdout.as_str()), (0, ""));
        let want = request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
            network: "testnet".into(),
            interface_name: "eth0".into(),
            container_id: "ctr-1".into(),
            pod_name: "pod".into(),
            pod_namespace: "ns".into(),
        });
        assert_eq!(del.sent, [Request { kind: Some(want) }]);
    }

    #[test]
    fn the_log_directory_is_made_only_when_missing() {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new();
        let nested = dir.0.join("a/b/cni.log");
        let mut file = open_log_creating_dir(&nested).unwrap();
        writeln!(file, "one").unwrap();
        let mode = fs::metadata(dir.0.join("a/b"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        // An existing directory keeps its mode; the file is appended to.
        fs::set_permissions(dir.0.join("a/b"), fs::Permissions::from_mode(0o755)).unwrap();
        writeln!(open_log_creating_dir(&nested).unwrap(), "two").unwrap();
        let mode = fs::metadata(dir.0.join("a/b"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        assert_eq!(fs::read_to_string(&nested).unwrap(), "one\ntwo\n");
        // A parent that is a file: an error, nothing made.
        let under_file = nested.join("cni.log");
        let err = open_log_creating_dir(&under_file).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotADirectory, "{err}");
    }

    #[test]
    fn gc_sends_the_valid_attachments() {
        let collected = Response::ok(response::Kind::Gc(envelope::GcResponse {
            released: vec![pod_ip("198.18.0.7", "198.18.0.0/24")],
        }));
        let valid = r#","cni.dev/valid-attachments":[{"containerID":"ctr-2","ifname":"net1"}]"#;
        let gc = invoke("GC", "", valid, vec![Ok(collected)]);
        assert_eq!((gc.code, gc.stdout.as_str()), (0, ""));
        let want = request::Kind::Gc(envelope::GcRequest {
            network: "testnet".into(),
            valid: vec![envelope::Attachment {
                container_id: "ctr-2".into(),
                interface_name: "net1".into(),
            }],
            grace_period_ms: conf::DEFAULT_GC_GRACE_PERIOD_MS,
            conf_name: "testnet".into(),
        });
        assert_eq!(gc.sent, [Request { kind: Some(want) }]);
    }
}
