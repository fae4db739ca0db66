//! Starting the daemon: the store opened and verified, static blocks
//! added, the socket bound, the cluster followed, then the loop until a
//! signal.

use std::sync::Arc;

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::checkpoints::defer_checkpoints;
use super::event_loop::{Admission, EventLoop, LoopParts};
use super::restore::{self, Keeper};
use super::socket::announce_start;
use super::{Config, DaemonError, handover, ownership};
use crate::engine::Engine;
use crate::log;
use crate::metrics::{self, Metrics};
use crate::store::{BootRecovery, Source, Store, StoreOptions};

/// Runs the daemon until SIGTERM/SIGINT.
pub fn run(config: &Config) -> Result<(), DaemonError> {
    log::info(
        "daemon",
        "metis daemon is starting",
        &[
            ("socket", &config.socket_path.display()),
            ("db", &config.db_path.display()),
            ("release_cooldown_ms", &config.release_cooldown_ms),
        ],
    );
    let signals = block_signals()?;
    let starting = announce_start(&config.socket_path)?;
    let claim = ownership::claim(&config.db_path)?;
    // Bound before the wait, so that a daemon stopping meanwhile can hand
    // its socket over (see `handover`).
    let pending = handover::prepare(&config.socket_path, config.socket_group)?;
    let Some(ownership) = claim.take(&signals)? else {
        log::info("daemon", "metis daemon stopped before serving", &[]);
        return Ok(());
    };
    restore::finish_interrupted_restore(&config.db_path);
    let mut store = open_store(config)?;
    isolate_problems(&mut store, config)?;
    let recovered_at_boot = recover_after_reboot(&mut store, config)?;
    apply_cidr_flags(&mut store, config)?;
    let checkpointer = defer_checkpoints(&store, &config.db_path);

    let listener = pending.install()?;
    drop(starting);
    let engine = Engine::new(store);
    let metrics = Arc::new(Metrics::default());
    metrics.recovered_at_boot(recovered_at_boot);
    metrics.rollback_repaired(engine.store().rollback_repairs());
    let keeper = Keeper::new(
        &config.db_path,
        store_options(config),
        checkpointer,
        Arc::clone(&metrics),
    );
    if let Some(addr) = config.metrics_addr {
        let bound = metrics::serve(addr, Arc::clone(&metrics), config.db_path.clone())
            .map_err(|err| DaemonError::Metrics(format!("{addr}: {err}")))?;
        log::info("daemon", "metrics listening", &[("addr", &bound)]);
    }
    let adaptive = follow_cluster(config, &metrics)?;
    log::info(
        "daemon",
        "listening",
        &[("socket", &config.socket_path.display())],
    );
    let mut engine = EventLoop::new(LoopParts {
        listener,
        signals,
        engine,
        keeper,
        adaptive,
        metrics,
        admission: Admission {
            max_connections: config.max_connections,
            limits: config.limits,
            allowed_uids: config.allowed_uids.clone(),
        },
    })
    .run();
    // Lets the next start skip reading every row (see verify_at_start).
    if let Err(err) = engine.store_mut().mark_clean_stop() {
        log::warn(
            "daemon",
            "could not record the clean stop; the next start reads every row",
            &[("error", &err)],
        );
    }
    // Only now may the next daemon write (the socket went at SIGTERM).
    drop(ownership);
    log::info("daemon", "metis daemon stopped", &[]);
    Ok(())
}

/// Blocks SIGTERM and SIGINT before anything else, so they queue on the fd
/// the loop polls.
fn block_signals() -> Result<SignalFd, DaemonError> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block().map_err(DaemonError::Signals)?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(DaemonError::Signals)
}

/// Opens the store (which records the release cooldown for direct mode).
fn open_store(config: &Config) -> Result<Store, DaemonError> {
    let store = Store::open(&config.db_path, &store_options(config)).map_err(DaemonError::Store)?;
    for warning in store.open_warnings() {
        log::warn("store", warning, &[]);
    }
    Ok(store)
}

fn store_options(config: &Config) -> StoreOptions {
    StoreOptions {
        durability: config.durability,
        reserve: Some(config.reserve),
        release_cooldown: Some(config.release_cooldown_ms),
        one_request: false,
    }
}

/// Fail safe, not fail stop: a node whose IPAM refuses to start can start
/// no pod. Only a database SQLite itself finds damaged is refused; every
/// problem that can be pinned to blocks quarantines those blocks (no new
/// allocations from them; their pods keep their addresses), loudly.
fn isolate_problems(store: &mut Store, config: &Config) -> Result<(), DaemonError> {
    let started = std::time::Instant::now();
    let report = store.verify_at_start().map_err(DaemonError::Store)?;
    log::info(
        "store",
        "database checked",
        &[
            ("scope", &report.scope()),
            ("blocks", &report.blocks),
            ("rows_read", &report.rows_read),
            ("took_ms", &started.elapsed().as_millis()),
        ],
    );
    if report.damaged {
        return Err(DaemonError::Unsafe(
            report.describe(&config.db_path.display().to_string()),
        ));
    }
    for problem in &report.problems {
        log::warn("store", "database check", &[("problem", problem)]);
    }
    let isolation = store
        .isolate_problems(&report, log::now_ms())
        .map_err(DaemonError::Store)?;
    for line in &isolation.deleted {
        log::warn("store", line, &[]);
    }
    if isolation.recounted > 0 {
        log::warn(
            "store",
            "recounted blocks whose allocated_ips did not match their rows",
            &[("blocks", &isolation.recounted)],
        );
    }
    match store.upstream_hazards() {
        Ok(hazards) => {
            for hazard in &hazards {
                log::info("store", hazard, &[]);
            }
        }
        Err(err) => log::warn(
            "store",
            "could not look for what upstream's store would trip on",
            &[("error", &err)],
        ),
    }
    match store.held_gateways() {
        Ok(held) => {
            for gateway in &held {
                log::warn("store", &gateway.describe(), &[]);
            }
        }
        Err(err) => log::warn(
            "store",
            "could not look for gateways held by pods",
            &[("error", &err)],
        ),
    }
    for q in &isolation.quarantined {
        log::error(
            "store",
            "block quarantined: nothing new is allocated from it; its pods keep their addresses; run `metis admin check` for details",
            &[
                ("block", &q.block_id),
                ("cidr", &q.cidr),
                ("network", &q.network),
                ("why", &q.why),
            ],
        );
    }
    Ok(())
}

/// Lays out the `--cidr` blocks: flags added since the last start add
/// blocks, flags removed retire theirs; a flag that overlaps another
/// network's block is refused alone, loudly.
fn apply_cidr_flags(store: &mut Store, config: &Config) -> Result<(), DaemonError> {
    let changes = store
        .configure_all(Source::Flag, &config.cidrs, log::now_ms())
        .map_err(DaemonError::Store)?;
    for line in &changes.lines {
        log::info("daemon", line, &[]);
    }
    for why in &changes.refused {
        log::error(
            "daemon",
            "--cidr refused; serving everything else",
            &[("error", why)],
        );
    }
    Ok(())
}

/// Starts the Kubernetes threads and the adaptive side that reads them,
/// when the configuration follows a cluster.
#[cfg(feature = "kube")]
fn follow_cluster(
    config: &Config,
    metrics: &Arc<Metrics>,
) -> Result<Option<crate::adaptive::Adaptive>, DaemonError> {
    use crate::kube::{self, client::ApiClient};
    let Some(settings) = &config.adaptive else {
        return Ok(None);
    };
    // The longest watch the server may be asked for (1–2× the timeout).
    let longest_watch = settings.timing.watch_timeout.saturating_mul(2);
    let client = ApiClient::new_or_broken(&settings.api, longest_watch);
    let link = kube::worker::spawn(
        client,
        settings.node_name.clone(),
        settings.adaptive.source,
        settings.timing,
    )
    .map_err(|err| DaemonError::Kube(err.to_string()))?;
    log::info(
        "daemon",
        "following the cluster",
        &[
            ("server", &settings.api.server),
            ("node", &settings.node_name),
            ("source", &format!("{:?}", settings.adaptive.source)),
        ],
    );
    Ok(Some(crate::adaptive::Adaptive::new(
        link,
        settings.adaptive.clone(),
        Arc::clone(metrics),
        std::time::Instant::now(),
    )))
}

/// The edge build follows no cluster (its flags refuse a cluster source).
#[cfg(not(feature = "kube"))]
fn follow_cluster(
    _config: &Config,
    _metrics: &Arc<Metrics>,
) -> Result<Option<super::no_cluster::Adaptive>, DaemonError> {
    Ok(None)
}

/// Releases the allocations of an earlier boot (see `store::boot`) before
/// anything is served, and returns how many were released (for metrics).
/// Without a readable boot id nothing is released.
pub fn recover_after_reboot(store: &mut Store, config: &Config) -> Result<u64, DaemonError> {
    let Some(boot_id) = crate::store::read_boot_id(&config.boot_id_path) else {
        log::warn(
            "daemon",
            "cannot read the boot id; allocations of an earlier boot are not released",
            &[("path", &config.boot_id_path.display())],
        );
        return Ok(0);
    };
    let outcome = store
        .recover_after_reboot(&boot_id, Some(config.boot_recovery), log::now_ms())
        .map_err(DaemonError::Store)?;
    match outcome {
        BootRecovery::Released(count) => log::info(
            "daemon",
            "new boot: released the allocations of the previous boot",
            &[("released", &count), ("boot_id", &boot_id)],
        ),
        BootRecovery::Disabled => log::info(
            "daemon",
            "new boot: keeping the previous boot's allocations (--no-boot-recovery)",
            &[("boot_id", &boot_id)],
        ),
        BootRecovery::FirstRecord | BootRecovery::SameBoot => {}
    }
    Ok(outcome.released())
}
