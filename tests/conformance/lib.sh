# Helpers shared by the conformance scripts (sourced, never run). The caller
# sets `passed=0 failed=0` and runs under bash.

pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed + 1)); }

# sql QUERY: one read of the caller's Metis database ($db). A reader can be
# told "database is locked" while another process recovers the WAL after a
# SIGKILL (a plugin in direct mode): it waits up to 5 s for the lock.
sql() { sqlite3 -readonly -cmd ".timeout 5000" "$db" "$1"; }

# wait_for SECONDS CMD...: poll CMD until it succeeds or the deadline passes.
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.05
    done
}

# podman_engine_conf WORK: the [containers] and [engine] sections of a
# containers.conf that bookworm's podman 4.3 needs on a root VM without
# systemd (learned here; append a [network] section if you need one):
# - podman depends on "crun | runc": with --no-install-recommends apt picks
#   crun unless runc is named, so runc is installed and runtime = "runc".
# - cgroup_manager = "cgroupfs" (no systemd; this VM has cgroup v1 hybrid)
#   and events_logger = "file" (no journald).
# - As root podman raises each container's RLIMIT_NOFILE/NPROC to 1048576
#   and beyond; without CAP_SYS_RESOURCE (this VM) runc then fails with
#   "error setting rlimit type 7: operation not permitted". Even NPROC at
#   the caller's hard limit was refused; lowering both to 1024 works.
podman_engine_conf() {
    cat <<CONF
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$1/events.log"
runtime = "runc"
tmp_dir = "$1/tmp"
CONF
}
