# Metis: see README.md. Every target works on a fresh machine with Rust.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo
# Where cargo puts its output: CARGO_TARGET_DIR when set, as cargo does.
TARGET_DIR := $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)
# Release binaries: static glibc, non-PIE, no unwind tables, SQLite's C at
# -Os, for a cheaper exec and a smaller binary (the figures: bench/history.md,
# "Build tuning, as once told in comments"). The host's triple is explicit so
# +crt-static reaches the binary but not build scripts and proc macros, and so
# `cargo bench` never overwrites it. The Containerfile's builder runs `make
# build`: these flags are set here and nowhere else.
HOST := $(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p')
NO_UNWIND := -C link-arg=-Wl,-T,$(CURDIR)/src/discard-eh-frame.ld -C link-arg=-Wl,--no-eh-frame-hdr
# Fewer text pages mapped per plugin exec: the Kubernetes side's code apart
# (the script), and file offsets 2 MiB-congruent with addresses so the page
# cache's large folios line up with fault-around's windows.
LAYOUT := -C link-arg=-Wl,-T,$(CURDIR)/src/kube-apart.ld -C link-arg=-Wl,-z,max-page-size=0x200000
STATIC := RUSTFLAGS="-C target-feature=+crt-static -C relocation-model=static $(NO_UNWIND) $(LAYOUT)" \
  CFLAGS_$(subst -,_,$(HOST))="-Os -fno-asynchronous-unwind-tables -fno-unwind-tables"
# Optimisation levels are Cargo.toml's `[profile.release.package]`, the same
# for both builds.
METIS := $(TARGET_DIR)/$(HOST)/release/metis
EDGE := $(TARGET_DIR)/edge/$(HOST)/release/metis
# The bench's floor, linked by `make build` exactly as $(METIS) (Cargo.toml).
FLOOR := $(TARGET_DIR)/$(HOST)/release/metis-floor

.PHONY: build edge demo test lint unit proto clean soak fuzz image

build:
	$(STATIC) $(CARGO) build --release --locked --target $(HOST)

# The edge build: no Kubernetes client (HTTP, TLS, YAML); static blocks,
# --cidr and direct mode only. Its own target directory, so it never
# replaces the full build's binary.
edge:
	$(STATIC) $(CARGO) build --release --locked --no-default-features --target $(HOST) --target-dir $(TARGET_DIR)/edge

# The container image (Containerfile), built offline: a statically linked
# release binary (glibc, +crt-static) copied onto `scratch`; nothing pulled.
# Podman's default storage (root: /var/lib/containers/storage, which CRI-O
# reads too); push with `podman push $(IMAGE) REGISTRY/metis:VERSION`.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -n 1)
IMAGE ?= localhost/metis:$(VERSION)
image: build
	@command -v podman >/dev/null || { echo "make image needs podman (apt-get install podman)"; exit 1; }
	podman build --pull=never --network=none --layers=false --build-arg BINARY_FROM=local \
	  --build-context local=$(TARGET_DIR)/$(HOST)/release -f Containerfile -t $(IMAGE) .
	podman image inspect --format '$(IMAGE): {{.Size}} bytes' $(IMAGE)

# ADD -> CHECK -> DEL through the real plugin binary against a real daemon
# on a temporary socket and database, with a 198.18.0.0/24 range.
demo: build
	@dir=$$(mktemp -d /tmp/metis-demo.XXXXXX)
	daemon_pid=
	cleanup() { if [ -n "$$daemon_pid" ]; then kill "$$daemon_pid" 2>/dev/null || true; wait "$$daemon_pid" || true; fi; rm -rf "$$dir"; }
	trap cleanup EXIT
	$(METIS) daemon --socket-path "$$dir/metis.sock" --db-path "$$dir/metis.sqlite" 2>"$$dir/daemon.log" &
	daemon_pid=$$!
	for _ in $$(seq 100); do [ -S "$$dir/metis.sock" ] && break; sleep 0.05; done
	[ -S "$$dir/metis.sock" ] || { echo "daemon did not start:"; cat "$$dir/daemon.log"; exit 1; }
	conf() { printf '{"cniVersion":"1.0.0","name":"demo","type":"metis","ipam":{"type":"metis","ranges":[[{"subnet":"198.18.0.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}],"daemonSocket":"%s","dbPath":"%s","logFile":"%s"}%s}' "$$dir/metis.sock" "$$dir/metis.sqlite" "$$dir/cni.log" "$${1:-}"; }
	plugin() { CNI_COMMAND=$$1 CNI_CONTAINERID=demo-container CNI_NETNS=/var/run/netns/demo \
	  CNI_IFNAME=eth0 CNI_PATH=/opt/cni/bin CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=demo" $(METIS); }
	echo "== ADD";   result=$$(conf | plugin ADD); echo "$$result"
	echo "== CHECK"; conf ",\"prevResult\":$$result" | plugin CHECK && echo "CHECK ok (exit 0)"
	echo "== DEL";   conf ",\"prevResult\":$$result" | plugin DEL && echo "DEL ok (exit 0)"
	echo "== stop daemon (SIGTERM)"; kill "$$daemon_pid"; wait "$$daemon_pid"; echo "daemon exited $$?"; daemon_pid=
	echo "== daemon log"; cat "$$dir/daemon.log"

# Everything CI runs: formatting, lints, unit and integration tests, for
# the full build and for the edge build (no default features).
test: lint unit

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --all-targets -- -D warnings
	$(CARGO) clippy --locked --all-targets --no-default-features -- -D warnings

unit:
	$(CARGO) test --locked --all-targets
	$(CARGO) test --locked --all-targets --no-default-features

# CNI conformance: libcni (built offline from Debian's source) drives Metis
# as the top-level plugin and as the IPAM of the real bridge and ptp plugins
# in network namespaces; GC and STATUS through the binary. Needs root; on
# Debian it installs the packages it lacks. One line per check, then a total.
# Then podman.sh: Podman runs busybox containers on bridge with Metis as IPAM
# (runc named, or apt picks crun for podman); and image.sh: the DaemonSet's
# shape, the init container and the daemon from `make image`'s image, the
# plugin on the host. All run; any failing fails.
.PHONY: conformance
CONFORMANCE_PACKAGES := busybox-static containernetworking-plugins golang-go golang-github-appc-cni-dev iproute2 iputils-ping podman runc sqlite3
conformance: build
	@if [ "$$(id -u)" != 0 ]; then echo "make conformance needs root (network namespaces)"; exit 1; fi
	missing=$$(for p in $(CONFORMANCE_PACKAGES); do dpkg -s "$$p" >/dev/null 2>&1 || echo "$$p"; done)
	if [ -n "$$missing" ]; then
	  export DEBIAN_FRONTEND=noninteractive
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null
	fi
	$(MAKE) --no-print-directory image
	rc=0
	tests/conformance/run.sh $(METIS) || rc=1
	tests/conformance/podman.sh $(METIS) || rc=1
	tests/conformance/image.sh $(IMAGE) || rc=1
	exit $$rc

# Regenerate src/wire/gen/ from proto/ (pure Rust, no protoc needed).
proto:
	METIS_WRITE_PROTO=1 $(CARGO) test --locked --test integration proto_sync::

clean:
	$(CARGO) clean

.PHONY: bench bench-smoke

# Performance of both builds as shipped (`make build`, `make edge`) vs
# host-local vs the floor, written to bench/results.md (a few minutes; needs
# /usr/lib/cni/host-local from containernetworking-plugins).
bench: build edge
	$(CARGO) bench --locked --bench metis -- --full $(METIS) --edge $(EDGE) --floor $(FLOOR) --out bench/results.md

# A few cycles of every measurement for both builds, checking results are
# sane (never timings).
bench-smoke: build edge
	$(CARGO) bench --locked --bench metis -- --full $(METIS) --edge $(EDGE) --floor $(FLOOR) --smoke

# Crash safety at full size: 20 rounds of 500 plugin operations with the
# daemon SIGKILLed at random (METIS_CRASH_ROUNDS/OPS/SEED to change), then
# 200 model-based sequences of 60 steps over changing configurations
# (METIS_MODEL_SEQUENCES/STEPS/SEED), then 60 sequences of 50 steps of many
# writers at once (METIS_WRITERS_SEQUENCES/STEPS/SEED), then 100 fresh
# nodes opened by plugins and a starting daemon at once (METIS_BUSY_ROUNDS),
# then the simulated cluster once more on a fresh seed (CLUSTER_SEED replays one).
soak:
	METIS_CRASH_ROUNDS=$${METIS_CRASH_ROUNDS:-20} METIS_CRASH_OPS=$${METIS_CRASH_OPS:-500} \
	  $(CARGO) test --locked --test integration crash:: -- --nocapture
	METIS_MODEL_SEQUENCES=$${METIS_MODEL_SEQUENCES:-200} METIS_MODEL_STEPS=$${METIS_MODEL_STEPS:-60} \
	  $(CARGO) test --locked --test integration model:: -- --nocapture
	METIS_WRITERS_SEQUENCES=$${METIS_WRITERS_SEQUENCES:-60} METIS_WRITERS_STEPS=$${METIS_WRITERS_STEPS:-50} \
	  $(CARGO) test --locked --test integration model_multi_writer:: -- --nocapture
	METIS_BUSY_ROUNDS=$${METIS_BUSY_ROUNDS:-100} \
	  $(CARGO) test --locked --test integration busy_writers:: -- --nocapture
	$(CARGO) test --locked --test integration cluster:: -- --nocapture

# Coverage-guided fuzzing on the stable toolchain: every target for
# FUZZ_SECONDS (default 600) each; see fuzz/run.sh.
fuzz:
	FUZZ_SECONDS=$${FUZZ_SECONDS:-600} fuzz/run.sh
