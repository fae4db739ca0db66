//! `deploy/`: every manifest parses, the RBAC grants exactly the API calls
//! the daemon makes, the DaemonSet wires up what the node needs, and every
//! example config list passes the plugin's own config validation.

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};

use metis::cli::install::validate_conflist;
use yaml_rust2::{Yaml, YamlLoader};

/// Every Kubernetes API call the daemon makes, as (API group, resource,
/// verb), matching upstream: it reads its Node (for the owner reference),
/// watches, creates and merge-patches its NodeNetworkConfig.
const DAEMON_API_CALLS: &[(&str, &str, &str)] = &[
    ("", "nodes", "get"),
    ("", "nodes", "list"),
    ("", "nodes", "watch"),
    ("networking.gke.io", "nodenetworkconfigs", "get"),
    ("networking.gke.io", "nodenetworkconfigs", "list"),
    ("networking.gke.io", "nodenetworkconfigs", "watch"),
    ("networking.gke.io", "nodenetworkconfigs", "create"),
    ("networking.gke.io", "nodenetworkconfigs", "patch"),
];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn files_with_extension(dir: &Path, extension: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == extension))
        .collect();
    files.sort();
    files
}

/// Every YAML document in `deploy/`, with the file it came from.
fn documents() -> Vec<(PathBuf, Yaml)> {
    let files = files_with_extension(&deploy_dir(), "yaml");
    assert!(files.len() >= 3, "{files:?}");
    let mut all = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        let docs = YamlLoader::load_from_str(&text)
            .unwrap_or_else(|err| panic!("{} does not parse: {err}", file.display()));
        for doc in docs {
            all.push((file.clone(), doc));
        }
    }
    all
}

fn of_kind(kind: &str) -> Vec<Yaml> {
    documents()
        .into_iter()
        .map(|(_, doc)| doc)
        .filter(|doc| doc["kind"].as_str() == Some(kind))
        .collect()
}

fn one(kind: &str) -> Yaml {
    let mut found = of_kind(kind);
    assert_eq!(found.len(), 1, "expected one {kind}");
    found.remove(0)
}

/// The object of `kind` named `name`.
fn named(kind: &str, name: &str) -> Yaml {
    let mut found: Vec<Yaml> = of_kind(kind)
        .into_iter()
        .filter(|doc| doc["metadata"]["name"].as_str() == Some(name))
        .collect();
    assert_eq!(found.len(), 1, "expected one {kind} {name}");
    found.remove(0)
}

/// Every (API group, resource, verb) a role's rules grant.
fn grants(role: &Yaml) -> Vec<(String, String, String)> {
    let mut granted = Vec::new();
    for rule in role["rules"].as_vec().unwrap() {
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                for verb in strings(&rule["verbs"]) {
                    granted.push((group.to_string(), resource.to_string(), verb.to_string()));
                }
            }
        }
    }
    granted
}

/// Every Kubernetes API call `metis controller` makes: one LIST+WATCH per
/// kind (a GET of one object after a 409), status updates of
/// NodeNetworkConfigs and pools, MetisBlocks created, updated and deleted
/// (the fence), Events; the Lease is a Role of its own namespace.
const CONTROLLER_API_CALLS: &[(&str, &str, &str)] = &[
    ("networking.gke.io", "nodenetworkconfigs", "get"),
    ("networking.gke.io", "nodenetworkconfigs", "list"),
    ("networking.gke.io", "nodenetworkconfigs", "watch"),
    ("networking.gke.io", "nodenetworkconfigs/status", "update"),
    ("", "nodes", "get"),
    ("", "nodes", "list"),
    ("", "nodes", "watch"),
    ("metis.x-k8s.io", "metispools", "get"),
    ("metis.x-k8s.io", "metispools", "list"),
    ("metis.x-k8s.io", "metispools", "watch"),
    ("metis.x-k8s.io", "metispools/status", "update"),
    ("metis.x-k8s.io", "metispools/status", "patch"),
    ("metis.x-k8s.io", "metisblocks", "get"),
    ("metis.x-k8s.io", "metisblocks", "list"),
    ("metis.x-k8s.io", "metisblocks", "watch"),
    ("metis.x-k8s.io", "metisblocks", "create"),
    ("metis.x-k8s.io", "metisblocks", "update"),
    ("metis.x-k8s.io", "metisblocks", "delete"),
    ("", "events", "create"),
];
const CONTROLLER_LEASE_CALLS: &[(&str, &str, &str)] = &[
    ("coordination.k8s.io", "leases", "get"),
    ("coordination.k8s.io", "leases", "create"),
    ("coordination.k8s.io", "leases", "update"),
];

fn assert_exactly(granted: &[(String, String, String)], wanted: &[(&str, &str, &str)], who: &str) {
    let granted: Vec<(&str, &str, &str)> = granted
        .iter()
        .map(|(g, r, v)| (g.as_str(), r.as_str(), v.as_str()))
        .collect();
    for call in wanted {
        assert!(granted.contains(call), "{who}: RBAC misses {call:?}");
    }
    for grant in &granted {
        assert!(
            wanted.contains(grant),
            "{who}: RBAC grants {grant:?}, which it never needs"
        );
    }
}

fn strings(list: &Yaml) -> Vec<&str> {
    list.as_vec()
        .map(|items| items.iter().filter_map(Yaml::as_str).collect())
        .unwrap_or_default()
}

#[test]
fn every_manifest_is_a_kubernetes_object() {
    for (file, doc) in documents() {
        for key in ["apiVersion", "kind"] {
            assert!(doc[key].as_str().is_some(), "{}: no {key}", file.display());
        }
        assert!(
            doc["metadata"]["name"].as_str().is_some(),
            "{}: no metadata.name",
            file.display()
        );
    }
}

#[test]
fn rbac_grants_exactly_the_daemons_api_calls() {
    let role = named("ClusterRole", "metis");
    assert_exactly(&grants(&role), DAEMON_API_CALLS, "daemon");

    let account = named("ServiceAccount", "metis");
    let binding = named("ClusterRoleBinding", "metis");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    assert_eq!(binding["roleRef"]["kind"].as_str(), Some("ClusterRole"));
    let subject = &binding["subjects"][0];
    assert_eq!(subject["kind"].as_str(), Some("ServiceAccount"));
    assert_eq!(subject["name"], account["metadata"]["name"]);
    assert_eq!(subject["namespace"], account["metadata"]["namespace"]);
    let daemonset = one("DaemonSet");
    assert_eq!(
        daemonset["spec"]["template"]["spec"]["serviceAccountName"],
        account["metadata"]["name"]
    );
    assert_eq!(
        daemonset["metadata"]["namespace"],
        account["metadata"]["namespace"]
    );
}

#[test]
fn the_crd_is_the_cluster_scoped_node_network_config() {
    let crd = named(
        "CustomResourceDefinition",
        "nodenetworkconfigs.networking.gke.io",
    );
    let spec = &crd["spec"];
    assert_eq!(
        crd["metadata"]["name"].as_str(),
        Some("nodenetworkconfigs.networking.gke.io")
    );
    assert_eq!(spec["group"].as_str(), Some("networking.gke.io"));
    assert_eq!(spec["scope"].as_str(), Some("Cluster"));
    assert_eq!(spec["names"]["kind"].as_str(), Some("NodeNetworkConfig"));
    assert_eq!(strings(&spec["names"]["shortNames"]), ["nnc"]);
    let version = &spec["versions"][0];
    assert_eq!(version["name"].as_str(), Some("v1"));
    assert!(version["subresources"]["status"].as_hash().is_some());
    let schema = &version["schema"]["openAPIV3Schema"]["properties"];
    let allocation = &schema["spec"]["properties"]["allocations"]["items"]["properties"];
    assert_eq!(allocation["pods"]["minimum"].as_i64(), Some(0));
    assert_eq!(allocation["network"]["default"].as_str(), Some("default"));
    let releasable = &schema["spec"]["properties"]["releasableCIDRs"];
    assert_eq!(strings(&releasable["x-kubernetes-list-map-keys"]), ["id"]);
    let pod_cidr = &schema["status"]["properties"]["podCIDRs"]["items"]["properties"];
    for field in ["id", "network", "cidr", "condition"] {
        assert!(!pod_cidr[field].is_badvalue(), "status.podCIDRs[].{field}");
    }
    assert!(!schema["status"]["properties"]["conditions"].is_badvalue());
}

#[test]
fn the_controller_gets_exactly_its_api_calls() {
    let role = named("ClusterRole", "metis-controller");
    assert_exactly(&grants(&role), CONTROLLER_API_CALLS, "controller");
    let lease_role = named("Role", "metis-controller-lease");
    assert_exactly(
        &grants(&lease_role),
        CONTROLLER_LEASE_CALLS,
        "controller lease",
    );
    let deployment = one("Deployment");
    let namespace = deployment["metadata"]["namespace"].as_str().unwrap();
    assert_eq!(
        lease_role["metadata"]["namespace"].as_str(),
        Some(namespace)
    );
    assert_eq!(deployment["spec"]["replicas"].as_i64(), Some(2));
    let pod = &deployment["spec"]["template"]["spec"];
    let account = named("ServiceAccount", "metis-controller");
    assert_eq!(pod["serviceAccountName"], account["metadata"]["name"]);
    for (kind, name) in [
        ("ClusterRoleBinding", "metis-controller"),
        ("RoleBinding", "metis-controller-lease"),
    ] {
        let binding = named(kind, name);
        let subject = &binding["subjects"][0];
        assert_eq!(subject["name"], account["metadata"]["name"], "{name}");
        assert_eq!(
            subject["namespace"], account["metadata"]["namespace"],
            "{name}"
        );
    }
    assert_eq!(
        named("RoleBinding", "metis-controller-lease")["roleRef"]["kind"].as_str(),
        Some("Role")
    );
    let container = &pod["containers"][0];
    let command = strings(&container["command"]);
    assert_eq!(command[..2], ["metis", "controller"]);
    let lease_namespace = command
        .iter()
        .position(|a| *a == "--lease-namespace")
        .unwrap();
    assert_eq!(
        command[lease_namespace + 1],
        namespace,
        "the Role is where the Lease is"
    );
    // The flags parse as the binary parses them (kube build), with the
    // identity Kubernetes substitutes.
    #[cfg(feature = "kube")]
    {
        let dir = common::TestDir::new("deploy-controller-flags");
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            "current-context: c\nclusters:\n- name: k\n  cluster:\n    server: http://127.0.0.1:1\ncontexts:\n- name: c\n  context:\n    cluster: k\n",
        )
        .unwrap();
        let kubeconfig = kubeconfig.display().to_string();
        let args: Vec<String> = command[2..]
            .iter()
            .map(|a| a.replace("$(POD_NAME)", "metis-controller-abc"))
            .collect();
        let config = metis::controller::parse_config(&args, &|name| {
            (name == "KUBECONFIG").then(|| kubeconfig.clone())
        })
        .unwrap_or_else(|err| panic!("controller flags in the Deployment: {err}"));
        assert_eq!(config.identity, "metis-controller-abc");
        assert!(config.metrics_address.is_some());
    }
}

#[test]
fn the_pool_crd_and_the_example_pool_agree() {
    let crd = named("CustomResourceDefinition", "metispools.metis.x-k8s.io");
    let spec = &crd["spec"];
    assert_eq!(spec["group"].as_str(), Some("metis.x-k8s.io"));
    assert_eq!(spec["scope"].as_str(), Some("Cluster"));
    assert_eq!(spec["names"]["kind"].as_str(), Some("MetisPool"));
    assert_eq!(spec["names"]["plural"].as_str(), Some("metispools"));
    let version = &spec["versions"][0];
    assert_eq!(version["name"].as_str(), Some("v1alpha1"));
    assert!(version["subresources"]["status"].as_hash().is_some());
    let fields = &version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    assert_eq!(
        fields["ipv4"]["properties"]["blockPrefixLength"]["default"].as_i64(),
        Some(28)
    );
    assert_eq!(
        fields["ipv6"]["properties"]["blockPrefixLength"]["default"].as_i64(),
        Some(124)
    );
    assert_eq!(fields["maxBlocksPerNode"]["default"].as_i64(), Some(64));
    assert_eq!(fields["reclaimDelay"]["default"].as_str(), Some("5m"));
    let pool = one("MetisPool");
    assert_eq!(pool["apiVersion"].as_str(), Some("metis.x-k8s.io/v1alpha1"));
    // The controller accepts the example as it is.
    #[cfg(feature = "kube")]
    {
        let text = fs::read_to_string(deploy_dir().join("metispool-example.yaml")).unwrap();
        let doc = &YamlLoader::load_from_str(&text).unwrap()[0];
        let json = yaml_to_json(&doc["spec"]);
        let spec = metis::controller::pool::parse_spec(&json)
            .unwrap_or_else(|err| panic!("example pool: {err}"));
        assert_eq!(spec.network, "default");
        assert_eq!(spec.ranges.len(), 2);
    }
}

/// The block CRD is the cluster-scoped MetisBlock the controller writes,
/// with the states it writes.
#[test]
fn the_block_crd_is_the_cluster_scoped_metis_block() {
    let crd = named("CustomResourceDefinition", "metisblocks.metis.x-k8s.io");
    let spec = &crd["spec"];
    assert_eq!(spec["group"].as_str(), Some("metis.x-k8s.io"));
    assert_eq!(spec["scope"].as_str(), Some("Cluster"));
    assert_eq!(spec["names"]["kind"].as_str(), Some("MetisBlock"));
    assert_eq!(spec["names"]["plural"].as_str(), Some("metisblocks"));
    let version = &spec["versions"][0];
    assert_eq!(version["name"].as_str(), Some("v1alpha1"));
    let fields = &version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    assert_eq!(
        strings(&fields["state"]["enum"]),
        ["Granted", "Cooling", "NonReusable"]
    );
}

#[cfg(feature = "kube")]
fn yaml_to_json(yaml: &Yaml) -> serde_json::Value {
    match yaml {
        Yaml::String(s) => serde_json::Value::from(s.as_str()),
        Yaml::Integer(i) => serde_json::Value::from(*i),
        Yaml::Boolean(b) => serde_json::Value::from(*b),
        Yaml::Array(items) => items.iter().map(yaml_to_json).collect(),
        Yaml::Hash(map) => map
            .iter()
            .filter_map(|(k, v)| Some((k.as_str()?.to_string(), yaml_to_json(v))))
            .collect::<serde_json::Map<_, _>>()
            .into(),
        _ => serde_json::Value::Null,
    }
}

#[test]
fn the_daemonset_wires_up_the_node() {
    let daemonset = one("DaemonSet");
    let pod = &daemonset["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"].as_bool(), Some(true));
    let host_paths: Vec<&str> = pod["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|volume| volume["hostPath"]["path"].as_str())
        .collect();
    for path in ["/var/lib/cni/metis", "/opt/cni/bin", "/etc/cni/net.d"] {
        assert!(host_paths.contains(&path), "missing hostPath {path}");
    }

    let daemon = &pod["containers"][0];
    let command = strings(&daemon["command"]);
    assert_eq!(command[..2], ["metis", "daemon"]);
    let source = command
        .iter()
        .position(|arg| *arg == "--cidr-source")
        .unwrap();
    assert_eq!(command[source + 1], "nnc");
    let node_name = daemon["env"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|env| env["name"].as_str() == Some("NODE_NAME"))
        .unwrap();
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("spec.nodeName")
    );
    assert_eq!(
        strings(&daemon["livenessProbe"]["exec"]["command"]),
        ["metis", "health"]
    );
    let mounts: Vec<&str> = daemon["volumeMounts"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|mount| mount["mountPath"].as_str())
        .collect();
    assert!(mounts.contains(&"/var/lib/cni/metis"), "{mounts:?}");
    // Co-writing host-local's directory during a migration needs it.
    assert!(mounts.contains(&"/var/lib/cni/networks"), "{mounts:?}");

    let init = &pod["initContainers"][0];
    let install = strings(&init["command"]);
    assert_eq!(install[..2], ["metis", "install"]);
    let cni_dir = install.iter().position(|arg| *arg == "--cni-dir").unwrap();
    let bin = format!("{}/bin", install[cni_dir + 1]);
    assert!(
        init["volumeMounts"]
            .as_vec()
            .unwrap()
            .iter()
            .any(|mount| mount["mountPath"].as_str() == Some(bin.as_str())),
        "the init container does not mount {bin}"
    );
}

/// `make image` tags `localhost/metis:VERSION`; tests/conformance/image.sh
/// runs that image with the daemon's restrictions pinned here.
#[test]
fn the_daemonset_runs_the_image_make_image_builds() {
    let image = format!("localhost/metis:{}", env!("CARGO_PKG_VERSION"));
    let makefile = fs::read_to_string(deploy_dir().join("../Makefile")).unwrap();
    assert!(makefile.contains("IMAGE ?= localhost/metis:$(VERSION)"));
    let daemonset = one("DaemonSet");
    let pod = &daemonset["spec"]["template"]["spec"];
    let containers = pod["initContainers"]
        .as_vec()
        .unwrap()
        .iter()
        .chain(pod["containers"].as_vec().unwrap());
    for container in containers {
        assert_eq!(container["image"].as_str(), Some(image.as_str()));
        let security = &container["securityContext"];
        assert_eq!(security["runAsUser"].as_i64(), Some(0));
        assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
    }
    let daemon = &pod["containers"][0]["securityContext"];
    assert_eq!(strings(&daemon["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(daemon["allowPrivilegeEscalation"].as_bool(), Some(false));
}

#[test]
fn the_daemonset_commands_parse_with_the_binarys_own_flags() {
    let daemonset = one("DaemonSet");
    let pod = &daemonset["spec"]["template"]["spec"];
    let args = |container: &Yaml| -> Vec<String> {
        strings(&container["command"])[2..]
            .iter()
            .map(|arg| arg.to_string())
            .collect()
    };
    metis::cli::install::parse(&args(&pod["initContainers"][0]), None).unwrap();
    let probe = strings(&pod["containers"][0]["livenessProbe"]["exec"]["command"]);
    let probe_args: Vec<String> = probe[2..].iter().map(|arg| arg.to_string()).collect();
    metis::cli::health::parse(&probe_args).unwrap();
    // The daemon's flags parse as they would in the pod, with a cluster
    // configured and NODE_NAME from the downward API.
    let dir = common::TestDir::new("deploy-daemon-flags");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "current-context: c\nclusters:\n- name: k\n  cluster:\n    server: http://127.0.0.1:1\ncontexts:\n- name: c\n  context:\n    cluster: k\n",
    )
    .unwrap();
    let kubeconfig = kubeconfig.display().to_string();
    let config = metis::daemon::parse_config(&args(&pod["containers"][0]), &|name| match name {
        "KUBECONFIG" => Some(kubeconfig.clone()),
        "NODE_NAME" => Some("node-a".into()),
        _ => None,
    });
    #[cfg(feature = "kube")]
    {
        let config = config.unwrap_or_else(|err| panic!("daemon flags in the DaemonSet: {err}"));
        let adaptive = config.adaptive.expect("a cluster source");
        assert_eq!(adaptive.node_name, "node-a");
        assert_eq!(adaptive.api.server, "http://127.0.0.1:1");
    }
    // The edge build cannot serve the DaemonSet's cluster source, and says so.
    #[cfg(not(feature = "kube"))]
    assert!(
        config
            .unwrap_err()
            .to_string()
            .contains("this build of metis does not have"),
    );
}

/// Through the real binary: the edge build refuses a cluster source as a
/// usage error (exit 2) that says how to get a build that has one.
#[cfg(not(feature = "kube"))]
#[test]
fn the_edge_build_refuses_a_cluster_source_with_exit_2() {
    let dir = common::TestDir::new("deploy-edge");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_metis"))
        .args(["daemon", "--cidr-source", "nnc", "--socket-path"])
        .arg(dir.join("metis.sock"))
        .arg("--db-path")
        .arg(dir.join("metis.sqlite"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("does not have"), "{stderr}");
    assert!(stderr.contains("cargo build --release"), "{stderr}");
    assert!(!dir.join("metis.sqlite").exists(), "nothing created");
}

/// Through the real binary: the edge build has no controller, and says why
/// as a usage error (exit 2).
#[cfg(not(feature = "kube"))]
#[test]
fn the_edge_build_refuses_the_controller_with_exit_2() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_metis"))
        .args(["controller", "--identity", "x"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("does not have Kubernetes support"),
        "{stderr}"
    );
    assert!(stderr.contains("cargo build --release"), "{stderr}");
}

/// Through the real binary: misuse is exit 2 with the usage, `--help` exit 0.
#[cfg(feature = "kube")]
#[test]
fn the_controller_refuses_bad_flags_with_exit_2() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_metis"))
            .arg("controller")
            .args(args)
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .unwrap()
    };
    let help = run(&["--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("--renew-deadline"));
    for args in [&["--nope"][..], &["--renew-deadline", "20s"], &[]] {
        let output = run(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("Usage: metis controller"),
            "{args:?}"
        );
    }
}

#[test]
fn every_example_conflist_passes_the_plugins_validation() {
    let files = files_with_extension(&deploy_dir().join("conflists"), "conflist");
    assert_eq!(files.len(), 3, "{files:?}");
    let mut families = Vec::new();
    for file in files {
        let bytes = fs::read(&file).unwrap();
        validate_conflist(&bytes).unwrap_or_else(|err| panic!("{}: {err}", file.display()));
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            text.contains("198.18.") || text.contains("2001:db8:"),
            "{}: use documentation ranges",
            file.display()
        );
        // The cloud publishes NodeNetworkConfig blocks for network
        // "default": a conflist allocating under another name (its
        // `name`, without ipam.network) would ask for capacity it never gets.
        let conflist: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            conflist["plugins"][0]["ipam"]["network"],
            "default",
            "{}",
            file.display()
        );
        families.push((text.contains("198.18."), text.contains("2001:db8:")));
    }
    assert!(families.contains(&(true, true)), "no dual-stack example");
}
