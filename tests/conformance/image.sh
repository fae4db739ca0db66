#!/usr/bin/env bash
# The deployment shape of deploy/daemonset.yaml through a real runtime:
# Podman runs the image `make image` built, as the DaemonSet's two containers
# would, and the plugin installed on the host serves pods through the
# daemon's socket in a host directory.
#
#   tests/conformance/image.sh IMAGE
#
# - init container: `metis install` from the image into a host directory
#   (read-only root filesystem, as root, like the manifest);
# - daemon: `metis daemon --cidr-source nnc` from the image, host network,
#   the state directory bind-mounted like the hostPath, read-only root
#   filesystem without podman's extra tmpfs mounts, every capability
#   dropped, no privilege escalation, as root (the manifest's runAsUser: 0).
#   Its API server is unreachable (a kubeconfig naming a closed port), so it
#   serves from local blocks, degraded, and parks an exhausted allocation;
# - on the host: the installed plugin serves ADD/CHECK/DEL through the
#   socket, and through the reference bridge plugin in a network namespace;
# - `metis health` exec'd in the container as the liveness probe is;
# - stopping the container answers the parked request (CNI code 11), exits
#   0 and leaves a database `metis admin check` (from the image) accepts;
# - starting it again keeps every allocation, also after SIGKILL left a
#   stale socket file; a state directory it cannot write stops it with the
#   reason.
#
# Needs root, podman, runc, iproute2, sqlite3 and bridge in /usr/lib/cni.
# Uses the image from podman's default storage and never pulls or pushes.
# Prints `PASS name` or `FAIL name: why` per check and `N passed, N failed`.
# Containers, the namespace, the bridge and the temporary directory are
# removed on exit, whatever happened. Addresses: 198.18.0.0/15 only.
set -euo pipefail
# shellcheck source=tests/conformance/lib.sh
source "$(dirname "$0")/lib.sh"

image=${1:?usage: image.sh IMAGE}
tag="mi$$"                          # prefix of our containers, netns, bridge
work=$(mktemp -d /tmp/metis-image.XXXXXX)
state="$work/state"                 # the hostPath /var/lib/cni/metis
cni_dir="$work/opt-cni"             # the hostPath /opt/cni (bin/ inside)
in_pod=/var/lib/cni/metis           # where the daemon container sees $state
socket="$state/metis-adaptive-ipam.sock"
db="$state/metis.sqlite"
bridge_prefix=198.19.215            # /24s that run.sh and podman.sh do not use
park_subnet=198.19.216.0/30         # one usable address: the second ADD parks
passed=0
failed=0
started_at=$SECONDS

export CONTAINERS_CONF="$work/containers.conf"

cleanup() {
    set +e
    # One name per call: podman 4.3's `rm -f` given a missing name removes none.
    local name
    for name in "$tag-daemon" "$tag-copy"; do podman rm -f -t 0 "$name" >/dev/null 2>&1; done
    ip netns delete "$tag-ns" 2>/dev/null
    ip link delete "$tag-br" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$state" "$cni_dir/bin" "$work/tmp" "$work/kube"
podman_engine_conf "$work" >"$CONTAINERS_CONF"
# An API server on a closed port: the daemon retries it with backoff.
cat >"$work/kube/config" <<EOF
apiVersion: v1
kind: Config
current-context: c
clusters:
- name: k
  cluster:
    server: http://127.0.0.1:1
contexts:
- name: c
  context:
    cluster: k
EOF

if ! podman image exists "$image"; then
    fail "image $image exists" "run \`make image\` first"
    echo "image: $passed passed, $failed failed"
    exit 1
fi

# The manifest's restrictions; the daemon adds capabilities: drop ALL.
locked=(--read-only --read-only-tmpfs=false --user 0 --network host)

# --- the init container: metis install into the host's /opt/cni/bin ---------
plugin="$cni_dir/bin/metis"
# The image's own binary, to compare the installed copy with.
podman create --name "$tag-copy" "$image" >/dev/null &&
    podman cp "$tag-copy:/usr/local/bin/metis" "$work/from-image" &&
    podman rm "$tag-copy" >/dev/null
if out=$(podman run --rm "${locked[@]}" -v "$cni_dir/bin:/host/opt/cni/bin" "$image" \
    metis install --cni-dir /host/opt/cni 2>&1) && [ -x "$plugin" ] &&
    cmp -s "$plugin" "$work/from-image" && version=$("$plugin" version); then
    pass "metis install from the image: the host runs the installed plugin ($version)"
else
    fail "metis install from the image" "$out"
    exit 1
fi

# --- the daemon container ------------------------------------------------------
probe() { podman exec "$tag-daemon" metis health; }
if podman run -d --name "$tag-daemon" "${locked[@]}" --cap-drop ALL \
    --security-opt no-new-privileges --stop-timeout 20 \
    -e NODE_NAME="$tag-node" -e KUBECONFIG=/etc/kube/config -v "$work/kube:/etc/kube:ro" \
    -v "$state:$in_pod" "$image" \
    metis daemon --cidr-source nnc --socket-path "$in_pod/metis-adaptive-ipam.sock" \
    --db-path "$in_pod/metis.sqlite" >/dev/null && wait_for 20 probe >/dev/null 2>&1; then
    pass "daemon container (read-only root, no capabilities) serves"
else
    fail "daemon container serves" "$(podman logs "$tag-daemon" 2>&1 | tail -n 5)"
    exit 1
fi

# The liveness probe: exit 0 and "Healthy" while the API server is away.
if out=$(probe 2>&1) && grep -q '^Healthy: .*degraded' <<<"$out"; then
    pass "metis health in the container (the liveness probe): $out"
else
    fail "metis health in the container" "$out"
fi

# --- the installed plugin on the host, through the socket --------------------
conf() { # conf NETWORK SUBNET [EXTRA_JSON]
    printf '{"cniVersion":"1.0.0","name":"%s","type":"metis","ipam":{"type":"metis","ranges":[[{"subnet":"%s"}]],"daemonSocket":"%s","dbPath":"%s","logFile":"%s"}%s}' \
        "$1" "$2" "$socket" "$db" "$work/cni.log" "${3:-}"
}
run_plugin() { # run_plugin VERB CONTAINER_ID < config
    CNI_COMMAND=$1 CNI_CONTAINERID=$2 CNI_NETNS=/var/run/netns/none CNI_IFNAME=eth0 \
        CNI_PATH="$cni_dir/bin" "$plugin"
}
held_by() { sql "SELECT group_concat(address) FROM ip_addresses WHERE container_id = '$1' AND is_allocated = 1"; }
allocations() { sql "SELECT container_id || ' ' || address FROM ip_addresses WHERE is_allocated = 1 AND container_id != '' ORDER BY 1"; }
# Direct mode would also allocate; the plugin logs when it falls back to it.
through_daemon() { ! grep -q "direct mode" "$work/cni.log" 2>/dev/null; }

net="$tag-net"    # the host plugin and bridge share it: one owner per range
if result=$(conf "$net" "$bridge_prefix.0/24" | run_plugin ADD "$tag-c1") &&
    addr=$(grep -o '"address": "[^"]*"' <<<"$result" | cut -d'"' -f4) &&
    [ "$(held_by "$tag-c1")" = "${addr%/*}" ] &&
    conf "$net" "$bridge_prefix.0/24" ",\"prevResult\":$result" | run_plugin CHECK "$tag-c1" &&
    conf "$net" "$bridge_prefix.0/24" ",\"prevResult\":$result" | run_plugin DEL "$tag-c1" &&
    [ -z "$(held_by "$tag-c1")" ] && through_daemon; then
    pass "host plugin ADD/CHECK/DEL through the container's socket ($addr)"
else
    fail "host plugin ADD/CHECK/DEL through the socket" "${result:-no result} $(tail -n 3 "$work/cni.log" 2>/dev/null)"
fi

# --- the bridge plugin in a namespace, Metis as its IPAM ----------------------
bridge_conf() { # bridge_conf [EXTRA_JSON]
    printf '{"cniVersion":"1.0.0","name":"%s","type":"bridge","bridge":"%s","isGateway":true,"ipMasq":false,"ipam":{"type":"metis","ranges":[[{"subnet":"%s.0/24"}]],"daemonSocket":"%s","dbPath":"%s","logFile":"%s"}%s}' \
        "$net" "$tag-br" "$bridge_prefix" "$socket" "$db" "$work/cni.log" "${1:-}"
}
run_bridge() { # run_bridge VERB < config
    CNI_COMMAND=$1 CNI_CONTAINERID="$tag-pod" CNI_NETNS="/var/run/netns/$tag-ns" CNI_IFNAME=eth0 \
        CNI_PATH="$cni_dir/bin:/usr/lib/cni" /usr/lib/cni/bridge
}
ip netns add "$tag-ns"
pod_addr=
if pod_result=$(bridge_conf | run_bridge ADD) &&
    pod_addr=$(held_by "$tag-pod") && [ -n "$pod_addr" ] &&
    ip -n "$tag-ns" -o -4 addr show dev eth0 | grep -q " $pod_addr/24 " &&
    ip netns exec "$tag-ns" ping -c 1 -W 2 "$bridge_prefix.1" >/dev/null &&
    bridge_conf ",\"prevResult\":$pod_result" | run_bridge CHECK && through_daemon; then
    pass "bridge in a netns: ADD ($pod_addr on eth0, pings the gateway) and CHECK"
else
    fail "bridge in a netns: ADD and CHECK" "${pod_result:-no result} $(tail -n 3 "$work/cni.log" 2>/dev/null)"
fi

# --- stop: the parked request is answered, the database is consistent ---------
park_net="$tag-park"
conf "$park_net" "$park_subnet" | run_plugin ADD "$tag-holder" >/dev/null ||
    fail "first ADD on the /30" "$(tail -n 3 "$work/cni.log")"
conf "$park_net" "$park_subnet" | run_plugin ADD "$tag-waiter" >"$work/waiter.json" &
waiter=$!
parked() { podman logs "$tag-daemon" 2>&1 | grep -q "exhaustion detected.*network=$park_net"; }
before=$(allocations)
if wait_for 8 parked && podman stop "$tag-daemon" >/dev/null; then
    waiter_rc=0
    wait "$waiter" || waiter_rc=$?
    exit_code=$(podman inspect --format '{{.State.ExitCode}}' "$tag-daemon")
    if [ "$waiter_rc" = 1 ] && grep -q '"code": 11' "$work/waiter.json" &&
        grep -q "daemon stopped while waiting" "$work/waiter.json" && [ "$exit_code" = 0 ]; then
        pass "podman stop answers the parked ADD (code 11) and the daemon exits 0"
    else
        fail "podman stop answers the parked ADD" "plugin exit $waiter_rc, daemon exit $exit_code: $(cat "$work/waiter.json")"
    fi
else
    wait "$waiter" || true
    fail "an ADD parks on the exhausted /30" "$(podman logs "$tag-daemon" 2>&1 | tail -n 3)"
fi
if out=$(podman run --rm "${locked[@]}" -v "$state:$in_pod" "$image" metis admin check 2>&1); then
    pass "metis admin check (from the image) after the stop"
else
    fail "metis admin check after the stop" "$out"
fi

# --- restart: every allocation kept, the pod's address still checks ----------
if podman start "$tag-daemon" >/dev/null && wait_for 20 probe >/dev/null 2>&1 &&
    [ "$(allocations)" = "$before" ] && [ -n "$before" ] &&
    bridge_conf ",\"prevResult\":$pod_result" | run_bridge CHECK; then
    pass "restarted container keeps every allocation ($(wc -l <<<"$before")) and CHECK passes"
else
    fail "restart keeps every allocation" "before: $before; after: $(allocations)"
fi
# SIGKILL leaves the socket file in the hostPath: the next start replaces it.
if podman kill "$tag-daemon" >/dev/null && podman wait "$tag-daemon" >/dev/null &&
    [ -S "$socket" ] && podman start "$tag-daemon" >/dev/null && wait_for 20 probe >/dev/null 2>&1 &&
    [ "$(allocations)" = "$before" ]; then
    pass "killed (SIGKILL, stale socket left) and started again: every allocation kept"
else
    fail "restart after SIGKILL" "$(podman logs "$tag-daemon" 2>&1 | tail -n 3)"
fi
if bridge_conf ",\"prevResult\":${pod_result:-null}" | run_bridge DEL && [ -z "$(held_by "$tag-pod")" ] &&
    conf "$park_net" "$park_subnet" | run_plugin DEL "$tag-holder" && [ -z "$(allocations)" ] &&
    through_daemon; then
    pass "DEL through bridge and the plugin after the restart: nothing held"
else
    fail "DEL after the restart" "left: $(allocations)"
fi

# --- a state directory the capability-less root cannot write -----------------
# (owned by another user): the daemon refuses with the reason, exit 1.
mkdir "$work/foreign"
chown 65534:65534 "$work/foreign"
if out=$(podman run --rm "${locked[@]}" --cap-drop ALL -v "$work/foreign:$in_pod" "$image" \
    metis daemon --cidr-source static 2>&1); then
    fail "unwritable state directory" "the daemon ran: $out"
elif grep -q "cannot take the database's lock file $in_pod/metis.sqlite.lock: Permission denied" <<<"$out"; then
    # The lock beside the database is the first file a daemon makes there.
    pass "unwritable state directory: the daemon exits non-zero naming the lock file beside the database"
else
    fail "unwritable state directory" "$out"
fi

echo "image: $passed passed, $failed failed in $((SECONDS - started_at)) s"
[ "$failed" -eq 0 ]
