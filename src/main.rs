//! The `metis` binary: a CNI plugin when the runtime executes it (with
//! `CNI_COMMAND` set), otherwise a set of subcommands. Exit codes are decided
//! here and nowhere else.
// On Linux with glibc the process starts as a C `main`, without the Rust
// runtime's start-up (`metis::start`), which every plugin exec would pay.
#![cfg_attr(all(target_os = "linux", target_env = "gnu"), no_main)]

use metis::cli::{ArgsError, CommandError, admin, check, downgrade, health, host_local, install};
use metis::flags::EXIT_USAGE;
use metis::{cni, daemon, log};

const ABOUT: &str = "Metis: node-local adaptive IPAM for Kubernetes pods.

Usage:
  metis                  run as a CNI IPAM plugin (CNI_COMMAND and friends set by the runtime)
  metis daemon [flags]   serve allocations for this node over a Unix socket
  metis controller [flags]  grant node blocks from MetisPools (cluster side, leader-elected)
  metis health [flags]   ask the daemon whether it is serving (exit 0 or 1; for liveness probes)
  metis install [flags]  copy this binary (and a network config) into the node's CNI directories
  metis admin LISTING    show cidr-blocks, ip-addresses or usage from the daemon
  metis admin check      verify a database's invariants, read-only (exit 1 on a problem)
  metis admin downgrade  ready a database for upstream Metis (a rollback; stop the daemon first)
  metis import host-local  record host-local's allocations of a network in Metis's database
  metis export host-local  write Metis's allocations of a network in host-local's format
  metis version          print the version

Run `metis COMMAND --help` for a command's flags.";

metis::entry_point!(run);

/// What the process does, as its exit status.
fn run() -> u8 {
    if std::env::var_os("CNI_COMMAND").is_some() {
        return cni::plugin::main();
    }
    let args: Vec<String> = match std::env::args_os()
        .skip(1)
        .map(|arg| arg.into_string())
        .collect()
    {
        Ok(args) => args,
        Err(arg) => {
            eprintln!("metis: argument {arg:?} is not valid UTF-8");
            return EXIT_USAGE;
        }
    };
    let Some((command, rest)) = args.split_first() else {
        // As the reference plugins do when run by hand: say what we are.
        eprintln!("{}", cni::plugin::about());
        return 0;
    };
    let (name, result) = match command.as_str() {
        "daemon" => ("metis daemon", run_daemon(rest)),
        "controller" => ("metis controller", run_controller(rest)),
        "health" => ("metis health", run_health(rest)),
        "install" => ("metis install", run_install(rest)),
        "admin" => run_admin(rest),
        "import" => run_host_local(host_local::Direction::Import, rest),
        "export" => run_host_local(host_local::Direction::Export, rest),
        "-h" | "--help" | "help" => {
            println!("{ABOUT}");
            return 0;
        }
        "--version" | "version" => {
            println!("metis {}", env!("CARGO_PKG_VERSION"));
            return 0;
        }
        other => {
            eprintln!("metis: unknown command {other:?}\n\n{ABOUT}");
            return EXIT_USAGE;
        }
    };
    exit_status(name, result)
}

/// The one place a subcommand's outcome becomes its exit status: help on
/// stdout (0), misuse on stderr with the usage (2), a failure's lines on
/// stderr (1).
fn exit_status(command: &str, result: Result<(), CommandError>) -> u8 {
    match result {
        Ok(()) => 0,
        Err(CommandError::Args(ArgsError::Help(text))) => {
            print!("{text}");
            0
        }
        Err(CommandError::Args(ArgsError::Usage { message, usage })) => {
            eprintln!("{command}: {message}\n\n{usage}");
            EXIT_USAGE
        }
        Err(CommandError::Failed(lines)) => {
            for line in lines {
                eprintln!("{command}: {line}");
            }
            1
        }
    }
}

fn run_daemon(args: &[String]) -> Result<(), CommandError> {
    let config = daemon::parse_config(args, &|name| std::env::var(name).ok())
        .map_err(|err| ArgsError::from_flags(err, daemon::usage()))?;
    log::init(Box::new(std::io::stderr()), config.verbosity);
    daemon::run(&config).map_err(|err| {
        log::error("daemon", "daemon failed to run", &[("error", &err)]);
        CommandError::Failed(Vec::new())
    })
}

#[cfg(feature = "kube")]
fn run_controller(args: &[String]) -> Result<(), CommandError> {
    use metis::controller;
    let config = controller::parse_config(args, &|name| std::env::var(name).ok())
        .map_err(|err| ArgsError::from_flags(err, controller::usage()))?;
    let sink: Box<dyn std::io::Write + Send> = match &config.log_file {
        Some(path) => Box::new(
            log::open_rotating(path, log::MAX_LOG_FILE_BYTES, 0o640).map_err(|err| {
                CommandError::failed(format!("cannot open --log-file {}: {err}", path.display()))
            })?,
        ),
        None => Box::new(std::io::stderr()),
    };
    log::init(sink, config.verbosity);
    controller::run(&config).map_err(|err| {
        log::error("controller", "controller failed to run", &[("error", &err)]);
        CommandError::Failed(Vec::new())
    })
}

/// The edge build has no Kubernetes client: say so, as a usage error.
#[cfg(not(feature = "kube"))]
fn run_controller(_args: &[String]) -> Result<(), CommandError> {
    Err(CommandError::Args(ArgsError::Usage {
        message: "this build of metis does not have Kubernetes support (built with \
                  --no-default-features); the controller needs the full build (cargo build \
                  --release, default features)"
            .to_string(),
        usage: String::new(),
    }))
}

/// Healthy on stdout, unhealthy on stderr, each as the probe's docs say.
fn run_health(args: &[String]) -> Result<(), CommandError> {
    let options = health::parse(args)?;
    match health::check(&options) {
        Ok(detail) => {
            println!("Healthy: {detail}");
            Ok(())
        }
        Err(err) => {
            eprintln!("Unhealthy: {err}");
            Err(CommandError::Failed(Vec::new()))
        }
    }
}

fn run_install(args: &[String]) -> Result<(), CommandError> {
    let options = install::parse(args, std::env::var("CNI_DIR").ok())?;
    let binary = std::env::current_exe()
        .map_err(install::InstallError::Source)
        .map_err(CommandError::failed)?;
    for path in install::run(&options, &binary).map_err(CommandError::failed)? {
        println!("installed {}", path.display());
    }
    Ok(())
}

fn run_host_local(
    direction: host_local::Direction,
    args: &[String],
) -> (&'static str, Result<(), CommandError>) {
    let result = host_local::parse(direction, args)
        .map_err(CommandError::from)
        .and_then(|options| {
            host_local::run(&options, &mut std::io::stdout(), &mut std::io::stderr())
        });
    (direction.command(), result)
}

fn run_admin(args: &[String]) -> (&'static str, Result<(), CommandError>) {
    let mut out = std::io::stdout();
    match args.split_first() {
        Some((sub, rest)) if sub == "check" => (
            "metis admin check",
            check::parse(rest)
                .map_err(CommandError::from)
                .and_then(|options| check::run(&options, &mut out)),
        ),
        Some((sub, rest)) if sub == "downgrade" => (
            "metis admin downgrade",
            downgrade::parse(rest)
                .map_err(CommandError::from)
                .and_then(|options| downgrade::run(&options, &mut out)),
        ),
        _ => ("metis admin", run_listing(args)),
    }
}

fn run_listing(args: &[String]) -> Result<(), CommandError> {
    let options = admin::parse(args)?;
    print!("{}", admin::run(&options).map_err(CommandError::failed)?);
    Ok(())
}
