//! The `metis` binary: a CNI plugin when the runtime executes it (with
//! `CNI_COMMAND` set), otherwise a set of subcommands. Exit codes are decided
//! here and nowhere else.

use std::process::ExitCode;

use metis::cli::{ArgsError, admin, health, host_local, install};
use metis::flags::{self, EXIT_USAGE};
use metis::{cli, cni, daemon, log};

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

fn main() -> ExitCode {
    if std::env::var_os("CNI_COMMAND").is_some() {
        return ExitCode::from(cni::plugin::main());
    }
    let args: Vec<String> = match std::env::args_os()
        .skip(1)
        .map(|arg| arg.into_string())
        .collect()
    {
        Ok(args) => args,
        Err(arg) => {
            eprintln!("metis: argument {arg:?} is not valid UTF-8");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let Some((command, rest)) = args.split_first() else {
        // As the reference plugins do when run by hand: say what we are.
        eprintln!("{}", cni::plugin::about());
        return ExitCode::SUCCESS;
    };
    match command.as_str() {
        "daemon" => run_daemon(rest),
        "controller" => run_controller(rest),
        "health" => run_health(rest),
        "install" => run_install(rest),
        "admin" => run_admin(rest),
        "import" => run_host_local(host_local::Direction::Import, rest),
        "export" => run_host_local(host_local::Direction::Export, rest),
        "-h" | "--help" | "help" => {
            println!("{ABOUT}");
            ExitCode::SUCCESS
        }
        "--version" | "version" => {
            println!("metis {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("metis: unknown command {other:?}\n\n{ABOUT}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

fn run_daemon(args: &[String]) -> ExitCode {
    let config = match flags::or_usage(
        daemon::parse_config(args, &|name| std::env::var(name).ok()),
        "metis daemon",
        daemon::usage,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    ) {
        Ok(config) => config,
        Err(status) => return ExitCode::from(status),
    };
    log::init(Box::new(std::io::stderr()), config.verbosity);
    match daemon::run(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            log::error("daemon", "daemon failed to run", &[("error", &err)]);
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "kube")]
fn run_controller(args: &[String]) -> ExitCode {
    use metis::controller;
    let config = match flags::or_usage(
        controller::parse_config(args, &|name| std::env::var(name).ok()),
        "metis controller",
        controller::usage,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    ) {
        Ok(config) => config,
        Err(status) => return ExitCode::from(status),
    };
    let sink: Box<dyn std::io::Write + Send> = match &config.log_file {
        Some(path) => match log::open_rotating(path, log::MAX_LOG_FILE_BYTES, 0o640) {
            Ok(file) => Box::new(file),
            Err(err) => {
                eprintln!(
                    "metis controller: cannot open --log-file {}: {err}",
                    path.display()
                );
                return ExitCode::FAILURE;
            }
        },
        None => Box::new(std::io::stderr()),
    };
    log::init(sink, config.verbosity);
    match controller::run(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            log::error("controller", "controller failed to run", &[("error", &err)]);
            ExitCode::FAILURE
        }
    }
}

/// The edge build has no Kubernetes client: say so, as a usage error.
#[cfg(not(feature = "kube"))]
fn run_controller(_args: &[String]) -> ExitCode {
    eprintln!(
        "metis controller: this build of metis does not have Kubernetes support (built with \
         --no-default-features); the controller needs the full build (cargo build --release, \
         default features)"
    );
    ExitCode::from(EXIT_USAGE)
}

/// Help goes to stdout (exit 0); misuse to stderr with the usage (exit 2).
fn args_failure(command: &str, err: ArgsError) -> ExitCode {
    match err {
        ArgsError::Help(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        ArgsError::Usage { message, usage } => {
            eprintln!("{command}: {message}\n\n{usage}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

fn run_health(args: &[String]) -> ExitCode {
    let options = match health::parse(args) {
        Ok(options) => options,
        Err(err) => return args_failure("metis health", err),
    };
    match health::check(&options) {
        Ok(detail) => {
            println!("Healthy: {detail}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("Unhealthy: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run_install(args: &[String]) -> ExitCode {
    let options = match install::parse(args, std::env::var("CNI_DIR").ok()) {
        Ok(options) => options,
        Err(err) => return args_failure("metis install", err),
    };
    let installed = std::env::current_exe()
        .map_err(install::InstallError::Source)
        .and_then(|binary| install::run(&options, &binary));
    match installed {
        Ok(paths) => {
            for path in paths {
                println!("installed {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("metis install: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run_host_local(direction: host_local::Direction, args: &[String]) -> ExitCode {
    ExitCode::from(host_local::run(
        direction,
        args,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    ))
}

fn run_admin(args: &[String]) -> ExitCode {
    if let Some((sub, rest)) = args.split_first() {
        let run = match sub.as_str() {
            "check" => Some(
                cli::check::run
                    as fn(&[String], &mut dyn std::io::Write, &mut dyn std::io::Write) -> u8,
            ),
            "downgrade" => Some(cli::downgrade::run as _),
            _ => None,
        };
        if let Some(run) = run {
            return ExitCode::from(run(rest, &mut std::io::stdout(), &mut std::io::stderr()));
        }
    }
    let options = match admin::parse(args) {
        Ok(options) => options,
        Err(err) => return args_failure("metis admin", err),
    };
    match admin::run(&options) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("metis admin: {err}");
            ExitCode::FAILURE
        }
    }
}
