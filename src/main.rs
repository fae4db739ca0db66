//! The `metis` binary: a CNI plugin when the runtime executes it (with
//! `CNI_COMMAND` set), otherwise a set of subcommands. Exit codes are decided
//! here and nowhere else.

use std::process::ExitCode;

use metis::flags::FlagError;
use metis::{cli, cni, daemon, log};

const ABOUT: &str = "Metis: node-local adaptive IPAM for Kubernetes pods.

Usage:
  metis                 run as a CNI IPAM plugin (CNI_COMMAND and friends set by the runtime)
  metis daemon [flags]  serve allocations for this node over a Unix socket
  metis admin check [--db-path PATH]
                        verify a database's invariants (read-only)

Run `metis daemon --help` for the daemon's flags.";

/// Exit code for command-line misuse, as most Unix tools use.
const USAGE_EXIT: u8 = 2;

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
            return ExitCode::from(USAGE_EXIT);
        }
    };
    let Some((command, rest)) = args.split_first() else {
        // As the reference plugins do when run by hand: say what we are.
        eprintln!("{}", cni::plugin::about());
        return ExitCode::SUCCESS;
    };
    match command.as_str() {
        "daemon" => run_daemon(rest),
        "admin" => run_admin(rest),
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
            ExitCode::from(USAGE_EXIT)
        }
    }
}

fn run_admin(args: &[String]) -> ExitCode {
    match args.split_first() {
        Some((sub, rest)) if sub == "check" => ExitCode::from(cli::check::run(
            rest,
            &mut std::io::stdout(),
            &mut std::io::stderr(),
        )),
        _ => {
            eprintln!("metis admin: expected a subcommand: check\n\n{ABOUT}");
            ExitCode::from(USAGE_EXIT)
        }
    }
}

fn run_daemon(args: &[String]) -> ExitCode {
    let config = match daemon::parse_config(args, &|name| std::env::var(name).ok()) {
        Ok(config) => config,
        Err(FlagError::Help) => {
            print!("{}", daemon::usage());
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("metis daemon: {err}\n\n{}", daemon::usage());
            return ExitCode::from(USAGE_EXIT);
        }
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
