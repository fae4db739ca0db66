#!/usr/bin/env bash
# CNI conformance of the metis binary against real clients and plugins:
# libcni (Debian's source, built offline by cniclient), the reference bridge
# and ptp plugins (/usr/lib/cni), real network namespaces.
#
#   tests/conformance/run.sh METIS_BINARY
#
# Needs root and: go (GOPATH mode), /usr/share/gocode (libcni), bridge and ptp
# in /usr/lib/cni, ip, ping, sqlite3 (`make conformance` installs them).
# Prints `PASS name` or `FAIL name: why` per check and `N passed, N failed`;
# exits non-zero if any check failed. Every namespace, link, process and
# temporary file it creates is removed on exit, whatever happened.
# Addresses: 198.18.0.0/15 and 2001:db8::/32 only.
set -uo pipefail
# shellcheck source=tests/conformance/lib.sh
source "$(dirname "$0")/lib.sh"

metis_src=${1:?usage: run.sh METIS_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
tag="mc$$"                           # prefix of every netns and link we create
work=$(mktemp -d /tmp/metis-conformance.XXXXXX)
daemon_pid=
passed=0
failed=0

cleanup() {
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$tag-" || true); do
        ip netns delete "$ns" 2>/dev/null || true
    done
    local link
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | grep "^$tag-" || true); do
        ip link delete "$link" 2>/dev/null || true
    done
    if [ -n "$daemon_pid" ]; then
        kill "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM


# --- setup: the binaries, the daemon ------------------------------------------
mkdir -p "$work/bin" "$work/cache" "$work/conf" "$work/gopath"
cp "$metis_src" "$work/bin/metis"
socket="$work/metis.sock"
db="$work/metis.sqlite"

# GOPATH mode cannot build an absolute path: build "." from inside it.
if (cd "$here/cniclient" && GO111MODULE=off GOFLAGS= GOPROXY=off GOPATH="$work/gopath:/usr/share/gocode" \
    GOCACHE="$work/gocache" go build -o "$work/bin/cniclient" .) 2>"$work/go-build.log"; then
    pass "build libcni client (GOPATH mode, offline)"
else
    fail "build libcni client" "$(tr '\n' ' ' <"$work/go-build.log")"
    echo "$passed passed, $failed failed"
    exit 1
fi

"$work/bin/metis" daemon --socket-path "$socket" --db-path "$db" 2>"$work/daemon.log" &
daemon_pid=$!
wait_for 10 test -S "$socket"
if [ -S "$socket" ]; then pass "daemon listens"; else fail "daemon listens" "$(cat "$work/daemon.log")"; exit 1; fi

cniclient() { "$work/bin/cniclient" -path "$work/bin:/usr/lib/cni" -cache "$work/cache" "$@"; }
# Allocated rows owned by a container (reserved rows have no owner).
held_by() { sql "SELECT COUNT(*) FROM ip_addresses WHERE container_id = '$1' AND is_allocated = 1"; }
# A network's pool: owned addresses, block counters, allocated rows.
pool_state() {
    sql "SELECT (SELECT COUNT(*) FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id
                 WHERE b.network = '$1' AND a.is_allocated = 1 AND a.container_id != ''),
                (SELECT SUM(allocated_ips) FROM cidr_blocks WHERE network = '$1'),
                (SELECT COUNT(*) FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id
                 WHERE b.network = '$1' AND a.is_allocated = 1)"
}

paths_json="\"daemonSocket\":\"$socket\",\"dbPath\":\"$db\",\"logFile\":\"$work/cni.log\""

# conflist NAME VERSION PLUGIN SUBNET: one plugin (metis, bridge or ptp) with
# metis as its IPAM. Each bridge network gets its own bridge (bridge refuses
# a second gateway address on one).
conflist() {
    local name=$1 version=$2 plugin=$3 subnet=$4 extra=
    case $plugin in
        bridge) extra="\"bridge\":\"$tag-b${version//./}\",\"isGateway\":true,\"ipMasq\":false," ;;
        ptp) extra="\"ipMasq\":false," ;;
    esac
    cat >"$work/conf/$name.conflist" <<EOF
{"cniVersion":"$version","name":"$name","plugins":[{"type":"$plugin",$extra
 "ipam":{"type":"metis","ranges":[[{"subnet":"$subnet"}]],"routes":[{"dst":"198.18.0.0/15"}],$paths_json}}]}
EOF
    echo "$work/conf/$name.conflist"
}

# --- ADD → CHECK → DEL through libcni, per plugin and version ---------------
# scenario PLUGIN VERSION SUBNET
scenario() {
    local plugin=$1 version=$2 subnet=$3
    local name="$plugin-${version//./}" id="ctr-$plugin-${version//./}"
    local ns="$tag-$name" list addr out
    list=$(conflist "$name" "$version" "$plugin" "$subnet")
    ip netns add "$ns"
    local netns="/var/run/netns/$ns"

    if ! out=$(cniclient add "$list" "$netns" "$id" 2>&1); then
        fail "$name ADD" "$out"; return
    fi
    addr=$(head -n1 <<<"$out")
    if [ "$(held_by "$id")" = 1 ]; then pass "$name ADD $addr (allocation recorded)"; else fail "$name ADD" "no allocation row for $id"; fi

    if [ "$plugin" != metis ]; then
        # Captured first: `grep -q` closing the pipe early would fail it under pipefail.
        out=$(ip -n "$ns" -o addr show dev eth0 2>&1)
        if grep -qw "inet ${addr}" <<<"$out"; then
            pass "$name address configured in the netns"
        else
            fail "$name address configured in the netns" "$(tr '\n' ' ' <<<"$out")"
        fi
        if ping -c 1 -W 2 "${addr%/*}" >/dev/null 2>&1; then
            pass "$name host reaches ${addr%/*}"
        else
            fail "$name host reaches ${addr%/*}" "no reply"
        fi
    fi

    if [ "$version" = 0.3.1 ]; then
        # libcni refuses CHECK below 0.4.0 without calling the plugin.
        if out=$(cniclient check "$list" "$netns" "$id" 2>&1); then
            fail "$name CHECK refused below 0.4.0" "libcni accepted it"
        else
            pass "$name CHECK refused below 0.4.0"
        fi
    elif out=$(cniclient check "$list" "$netns" "$id" 2>&1); then
        pass "$name CHECK"
    else
        fail "$name CHECK" "$out"
    fi

    if ! out=$(cniclient del "$list" "$netns" "$id" 2>&1); then
        fail "$name DEL" "$out"; return
    fi
    if [ "$(held_by "$id")" = 0 ]; then pass "$name DEL released the allocation"; else fail "$name DEL" "allocation still held"; fi
    if [ "$plugin" != metis ]; then
        if ip -n "$ns" link show eth0 >/dev/null 2>&1; then
            fail "$name DEL removed eth0" "eth0 still exists"
        else
            pass "$name DEL removed eth0"
        fi
    fi

    if out=$(cniclient add "$list" "$netns" "$id" 2>&1) && [ "$(held_by "$id")" = 1 ]; then
        pass "$name second ADD after DEL $(head -n1 <<<"$out")"
    else
        fail "$name second ADD after DEL" "$out"
    fi
    if out=$(cniclient del "$list" "$netns" "$id" 2>&1) && [ "$(held_by "$id")" = 0 ]; then
        pass "$name second DEL"
    else
        fail "$name second DEL" "$out"
    fi
    ip netns delete "$ns"
}

third=0
for version in 0.3.1 0.4.0 1.0.0; do
    for plugin in metis bridge ptp; do
        third=$((third + 1))
        scenario "$plugin" "$version" "198.18.$third.0/24"
    done
done

# --- burst: 100 concurrent ADDs, then 100 DELs --------------------------------
burst_list=$(conflist burst 1.0.0 ptp 198.18.100.0/24)
for i in $(seq 0 99); do ip netns add "$tag-burst-$i"; done
# One ADD and DEL first so the block exists: "as it started" is then exact.
cniclient add "$burst_list" "/var/run/netns/$tag-burst-0" warmup >/dev/null &&
    cniclient del "$burst_list" "/var/run/netns/$tag-burst-0" warmup >/dev/null
before=$(pool_state burst)
if out=$(cniclient -timeout 120s burst-add "$burst_list" "$tag-burst" 100 2>&1); then
    distinct=$(sort -u <<<"$out" | grep -c /)
    if [ "$distinct" = 100 ]; then pass "burst: 100 concurrent ADDs, 100 distinct addresses"; else fail "burst ADD" "$distinct distinct addresses"; fi
else
    fail "burst ADD" "$(tail -c 2000 <<<"$out")"
fi
if out=$(cniclient -timeout 120s burst-del "$burst_list" "$tag-burst" 100 2>&1); then
    after=$(pool_state burst)
    if [ "$after" = "$before" ]; then
        pass "burst: 100 DELs leave the pool as it started (owned|counter|rows = $after)"
    else
        fail "burst DEL" "pool (owned|counter|rows) was $before, is $after"
    fi
else
    fail "burst DEL" "$(tail -c 2000 <<<"$out")"
fi
for i in $(seq 0 99); do ip netns delete "$tag-burst-$i"; done

# --- live migration: pods made by host-local keep pinging under Metis ---------
# mig_list IPAM: the operator's bridge conflist, host-local syntax, with only
# the IPAM type changing between the two. The route names its gateway:
# host-local leaves `gw` out of the result, and bridge's CHECK then looks for
# a gateway-less route that its own ADD never installed.
mig_list() {
    cat >"$work/conf/mig-$1.conflist" <<EOF
{"cniVersion":"1.0.0","name":"mig","plugins":[{"type":"bridge","bridge":"$tag-bm","isGateway":true,"ipMasq":false,
 "ipam":{"type":"$1","ranges":[[{"subnet":"198.18.210.0/24","rangeStart":"198.18.210.10"}]],
 "routes":[{"dst":"198.18.0.0/15","gw":"198.18.210.1"}],"dataDir":"$work/hl",$paths_json}}]}
EOF
    echo "$work/conf/mig-$1.conflist"
}
hl_list=$(mig_list host-local)
metis_list=$(mig_list metis)
declare -A mig_addr
for pod in p0 p1; do
    ip netns add "$tag-mig-$pod"
    if out=$(cniclient add "$hl_list" "/var/run/netns/$tag-mig-$pod" "mig-$pod" 2>&1); then
        mig_addr[$pod]=$(head -n1 <<<"$out")
    else
        fail "migration: host-local ADD $pod" "$out"
    fi
done
if out=$("$work/bin/metis" import host-local --config "$hl_list" 2>&1) &&
    [ "$(held_by mig-p0)/$(held_by mig-p1)" = 1/1 ]; then
    pass "migration: import host-local with the daemon running records ${mig_addr[p0]:-?} and ${mig_addr[p1]:-?}"
else
    fail "migration: import host-local" "$out"
fi
ip netns add "$tag-mig-p2"
if out=$(cniclient add "$metis_list" "/var/run/netns/$tag-mig-p2" mig-p2 2>&1); then
    mig_addr[p2]=$(head -n1 <<<"$out")
    if [ "${mig_addr[p2]}" != "${mig_addr[p0]:-}" ] && [ "${mig_addr[p2]}" != "${mig_addr[p1]:-}" ]; then
        pass "migration: Metis ADD after the swap gives a new address ${mig_addr[p2]}"
    else
        fail "migration: Metis ADD after the swap" "re-issued ${mig_addr[p2]}"
    fi
else
    fail "migration: Metis ADD after the swap" "$out"
fi
for pod in p0 p1; do
    target=${mig_addr[$pod]:-none}
    if ping -c 1 -W 2 "${target%/*}" >/dev/null 2>&1 &&
        ip netns exec "$tag-mig-p2" ping -c 1 -W 2 "${target%/*}" >/dev/null 2>&1; then
        pass "migration: host and the new pod reach host-local-era $pod ${target%/*}"
    else
        fail "migration: $pod ${target%/*} reachable after the swap" "no reply"
    fi
done
if out=$(cniclient check "$metis_list" "/var/run/netns/$tag-mig-p0" mig-p0 2>&1); then
    pass "migration: Metis CHECK of a host-local-era pod"
else
    fail "migration: Metis CHECK of a host-local-era pod" "$out"
fi
if out=$(cniclient del "$metis_list" "/var/run/netns/$tag-mig-p0" mig-p0 2>&1) && [ "$(held_by mig-p0)" = 0 ]; then
    pass "migration: Metis DEL releases a host-local-era pod"
else
    fail "migration: Metis DEL of a host-local-era pod" "$out"
fi
if out=$("$work/bin/metis" export host-local --config "$metis_list" --data-dir "$work/hl-back" 2>&1) &&
    [ -f "$work/hl-back/mig/${mig_addr[p2]%/*}" ] && [ -f "$work/hl-back/mig/${mig_addr[p1]%/*}" ]; then
    pass "migration: export host-local writes every pod's address back"
else
    fail "migration: export host-local" "$out"
fi
for pod in p0 p1 p2; do ip netns delete "$tag-mig-$pod" 2>/dev/null; done

# --- GC and STATUS (1.1.0; Debian's libcni predates them): the binary itself --
conf11() { # conf11 NAME SUBNET [EXTRA_TOP_LEVEL]
    printf '{"cniVersion":"1.1.0","name":"%s","type":"metis","ipam":{"type":"metis","ranges":[[{"subnet":"%s"}]],"gcGracePeriod":"0s",%s}%s}' \
        "$1" "$2" "$paths_json" "${3:-}"
}
plugin() { # plugin VERB CONTAINER_ID < config
    env -i CNI_COMMAND="$1" CNI_CONTAINERID="$2" CNI_NETNS=/var/run/netns/none CNI_IFNAME=eth0 \
        CNI_PATH="$work/bin" "$work/bin/metis"
}

conf11 gc 198.18.200.0/24 | plugin ADD gc-keep >/dev/null
conf11 gc 198.18.200.0/24 | plugin ADD gc-stale >/dev/null
conf11 gc-other 198.18.201.0/24 | plugin ADD gc-stale >/dev/null
valid=',"cni.dev/valid-attachments":[{"containerID":"gc-keep","ifname":"eth0"}]'
if out=$(conf11 gc 198.18.200.0/24 "$valid" | plugin GC "" 2>&1) && [ -z "$out" ]; then
    kept=$(held_by gc-keep)
    stale=$(sql "SELECT COUNT(*) FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id WHERE a.container_id = 'gc-stale' AND a.is_allocated = 1 AND b.network = 'gc'")
    other=$(sql "SELECT COUNT(*) FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id WHERE a.container_id = 'gc-stale' AND a.is_allocated = 1 AND b.network = 'gc-other'")
    if [ "$kept/$stale/$other" = 1/0/1 ]; then
        pass "GC releases the unlisted allocation, keeps the listed one and other networks"
    else
        fail "GC" "kept/stale/other-network = $kept/$stale/$other, want 1/0/1"
    fi
else
    fail "GC" "$out"
fi

if out=$(conf11 gc 198.18.200.0/24 | plugin STATUS "" 2>&1); then
    pass "STATUS 0 with the daemon up and free addresses"
else
    fail "STATUS with the daemon up" "$out"
fi
conf11 full 198.18.202.0/30 | plugin ADD full-1 >/dev/null
out=$(conf11 full 198.18.202.0/30 | plugin STATUS "" 2>&1)
if [ $? -ne 0 ] && grep -q '"code": 50' <<<"$out"; then
    pass "STATUS 50 when the pool is exhausted"
else
    fail "STATUS on an exhausted pool" "$out"
fi

kill "$daemon_pid"; wait "$daemon_pid" 2>/dev/null; daemon_pid=
sum_before=$(sha256sum "$db")
if out=$(conf11 gc 198.18.200.0/24 | plugin STATUS "" 2>&1) && [ "$(sha256sum "$db")" = "$sum_before" ]; then
    pass "STATUS 0 in direct mode, database untouched"
else
    fail "STATUS in direct mode" "${out:-the database changed}"
fi
if out=$(conf11 gc 198.18.200.0/24 | plugin DEL gc-keep 2>&1) && [ "$(held_by gc-keep)" = 0 ]; then
    pass "DEL with the daemon down (direct mode)"
else
    fail "DEL with the daemon down" "$out"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
