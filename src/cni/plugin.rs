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
use crate::cni::conf::{self, NetConf};
use crate::cni::env::{self, CniEnv, Verb};
use crate::cni::error::CniError;
use crate::cni::result::{self, AllocatedIp};
use crate::cni::{backend, version};
use crate::log;
use crate::wire::envelope::v1 as envelope;
use crate::wire::{Code, Request, Response, ipam, request, response};

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
    )
}

/// Runs one CNI invocation and returns the exit code. An empty
/// `CNI_COMMAND` gets the "about" text on stderr and success, as skel does.
pub fn run(
    lookup: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> u8 {
    let (output, code) = match execute(lookup, stdin) {
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
    if let Some(text) = output {
        let written = stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.write_all(b"\n"))
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
fn execute(
    lookup: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
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
    let with_version = |err: CniError| (err, net_conf.cni_version.clone());
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
    let outcome = match cni_env.verb {
        Verb::Add => add(&net_conf, &cni_env, &cni_args).map(Some),
        Verb::Del => del(&net_conf, &cni_env, &cni_args).map(|()| None),
        Verb::Check => check(&net_conf, &cni_env, &cni_args).map(|()| None),
        Verb::Status => status(&net_conf).map(|()| None),
        Verb::Gc => gc(&net_conf).map(|()| None),
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
/// [`log::MAX_LOG_FILE_BYTES`]; logging never fails the command.
fn open_log(path: &Path, cni_env: &CniEnv) {
    if let Some(dir) = path.parent() {
        let _ = fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir);
    }
    // Every line of this invocation names its verb and container.
    log::set_context(&[
        ("verb", &cni_env.verb.as_str()),
        ("container_id", &cni_env.container_id),
    ]);
    if let Ok(file) = log::open_rotating(path, log::MAX_LOG_FILE_BYTES, 0o644) {
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

fn add(net_conf: &NetConf, cni_env: &CniEnv, cni_args: &CniArgs) -> Result<String, CniError> {
    net_conf.require_ranges()?;
    let requested = net_conf.requested_addresses(cni_args)?;
    let ip_config = |family: Family, ranges: &[Cidr]| -> Option<ipam::IpConfig> {
        let (first, rest) = ranges.split_first()?;
        Some(ipam::IpConfig {
            interface_name: cni_env.ifname.clone(),
            container_id: cni_env.container_id.clone(),
            initial_pod_cidr: first.to_string(),
            additional_pod_cidrs: rest.iter().map(Cidr::to_string).collect(),
            requested_ip: requested
                .iter()
                .find(|ip| Family::of(**ip) == family)
                .map(IpAddr::to_string)
                .unwrap_or_default(),
        })
    };
    let request = request::Kind::Allocate(ipam::AllocatePodIpRequest {
        network: net_conf.network.clone(),
        ipv4_config: ip_config(Family::V4, &net_conf.ipv4_ranges),
        ipv6_config: ip_config(Family::V6, &net_conf.ipv6_ranges),
        pod_name: cni_args.pod_name.clone(),
        pod_namespace: cni_args.pod_namespace.clone(),
        isolated: net_conf.isolated,
    });
    let response = send(net_conf, request)?;
    let Some(response::Kind::Allocate(allocated)) = response.kind else {
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
    ))
}

fn del(net_conf: &NetConf, cni_env: &CniEnv, cni_args: &CniArgs) -> Result<(), CniError> {
    let request = request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
        network: net_conf.network.clone(),
        interface_name: cni_env.ifname.clone(),
        container_id: cni_env.container_id.clone(),
        pod_name: cni_args.pod_name.clone(),
        pod_namespace: cni_args.pod_namespace.clone(),
    });
    send(net_conf, request).map(|_| ())
}

fn check(net_conf: &NetConf, cni_env: &CniEnv, cni_args: &CniArgs) -> Result<(), CniError> {
    if !version::has_check(&net_conf.cni_version) {
        return Err(CniError::incompatible_version(format!(
            "config version {} does not allow CHECK",
            net_conf.cni_version
        )));
    }
    let request = request::Kind::Check(ipam::CheckPodIpRequest {
        network: net_conf.network.clone(),
        interface_name: cni_env.ifname.clone(),
        container_id: cni_env.container_id.clone(),
        pod_name: cni_args.pod_name.clone(),
        pod_namespace: cni_args.pod_namespace.clone(),
    });
    let response = send(net_conf, request)?;
    let Some(response::Kind::Check(checked)) = response.kind else {
        return Err(CniError::unexpected_response("check"));
    };
    let mut expected = net_conf.prev_result_ips()?;
    if net_conf.prev_result.is_none() {
        return Ok(());
    }
    let mut actual = checked
        .allocated
        .iter()
        .map(|pod_ip| allocated_ip(pod_ip).map(|ip| ip.address))
        .collect::<Result<Vec<_>, _>>()?;
    expected.sort();
    actual.sort();
    if expected != actual {
        return Err(CniError::allocation_differs(format!(
            "prevResult lists {expected:?} but the allocation holds {actual:?}"
        )));
    }
    Ok(())
}

/// STATUS: 0 when an ADD could be served now, else code 50 with the reason.
/// One read-only round trip (or read-only direct mode), so kubelet's
/// 5-second poll costs nothing and never creates a database.
fn status(net_conf: &NetConf) -> Result<(), CniError> {
    require_gc_and_status(net_conf, "STATUS")?;
    net_conf.require_ranges()?;
    let request = Request {
        kind: Some(request::Kind::NetworkStatus(
            envelope::NetworkStatusRequest {
                network: net_conf.network.clone(),
                ipv4_ranges: net_conf.ipv4_ranges.iter().map(Cidr::to_string).collect(),
                ipv6_ranges: net_conf.ipv6_ranges.iter().map(Cidr::to_string).collect(),
            },
        )),
    };
    let unavailable = |err: CniError| CniError::plugin_not_available(err.to_string());
    let response = backend::call_read_only(&net_conf.daemon_socket, &net_conf.db_path, &request)
        .map_err(unavailable)?;
    let Some(response) = response else {
        return Ok(());
    };
    if response.code() != Code::Ok {
        return Err(unavailable(CniError::from_status(response.status.as_ref())));
    }
    match response.kind {
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
fn gc(net_conf: &NetConf) -> Result<(), CniError> {
    require_gc_and_status(net_conf, "GC")?;
    let valid = net_conf
        .valid_attachments
        .iter()
        .flatten()
        .map(|a| envelope::Attachment {
            container_id: a.container_id.clone(),
            interface_name: a.ifname.clone(),
        })
        .collect();
    let request = request::Kind::Gc(envelope::GcRequest {
        network: net_conf.network.clone(),
        valid,
        grace_period_ms: net_conf.gc_grace_period_ms,
    });
    let response = send(net_conf, request)?;
    let Some(response::Kind::Gc(collected)) = response.kind else {
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
    if version::has_gc_and_status(&net_conf.cni_version) {
        return Ok(());
    }
    Err(CniError::incompatible_version(format!(
        "config version {} does not allow {verb}",
        net_conf.cni_version
    )))
}

/// Sends a request and turns a non-OK status into the matching CNI error.
fn send(net_conf: &NetConf, kind: request::Kind) -> Result<Response, CniError> {
    let request = Request { kind: Some(kind) };
    let response = backend::call(&net_conf.daemon_socket, &net_conf.db_path, &request)?;
    if response.code() == Code::Ok {
        Ok(response)
    } else {
        Err(CniError::from_status(response.status.as_ref()))
    }
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
    Ok(AllocatedIp { address, block })
}
