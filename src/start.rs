//! How the `metis` binary (and the bench's floor) begin on Linux with glibc:
//! as a C `main` (`#![no_main]`), without the Rust runtime's start-up. That
//! start-up reads `/proc/self/maps` for the main thread's stack guard and
//! sets up an alternate signal stack and fault handlers, paid by every
//! plugin exec (bench/history.md); what of it a process needs is here.
//! Lost with the rest: the message naming a stack overflow (the process
//! still dies of SIGSEGV).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, IntoRawFd};

use nix::fcntl::{FcntlArg, fcntl};

/// Defines a binary's entry point around `$run`, a `fn() -> u8` giving the
/// exit status: on Linux with glibc a C `main` that runs it through
/// [`run`] (the binary's root declares `#![no_main]` there; `argc` and
/// `argv` are not needed, as `std::env::args` reads what glibc hands its
/// constructors), elsewhere Rust's own `main`.
#[macro_export]
macro_rules! entry_point {
    ($run:path) => {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        #[allow(unsafe_code)]
        #[unsafe(no_mangle)]
        extern "C" fn main(
            _argc: ::std::ffi::c_int,
            _argv: *const *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            $crate::start::run($run)
        }

        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        fn main() -> ::std::process::ExitCode {
            ::std::process::ExitCode::from($run())
        }
    };
}

/// Readies the process as the runtime's start-up would, then runs `main`
/// and returns its exit status once stdout is flushed (nothing else
/// flushes it when `main` returns to C).
pub fn run(main: impl FnOnce() -> u8) -> i32 {
    open_closed_standard_descriptors();
    ignore_sigpipe();
    let code = main();
    let _ = std::io::stdout().flush();
    i32::from(code)
}

/// Opens `/dev/null` on each standard descriptor that is closed, so that no
/// file opened later takes its number: stdout carries the CNI result, and a
/// log or database opened as descriptor 1 would receive it.
fn open_closed_standard_descriptors() {
    let (stdin, stdout, stderr) = (std::io::stdin(), std::io::stdout(), std::io::stderr());
    let standard: [BorrowedFd<'_>; 3] = [stdin.as_fd(), stdout.as_fd(), stderr.as_fd()];
    for fd in standard {
        if fcntl(fd, FcntlArg::F_GETFD) == Err(nix::errno::Errno::EBADF) {
            // The lowest free number is this one: those below are open.
            let null = OpenOptions::new().read(true).write(true).open("/dev/null");
            if let Ok(null) = null {
                let _kept_open = null.into_raw_fd();
            }
        }
    }
}

/// A write to a pipe or socket whose reader is gone fails with EPIPE
/// instead of killing the process: a daemon that vanished mid-exchange is
/// an error the plugin reports, not its death by signal.
#[allow(unsafe_code)]
fn ignore_sigpipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: SIG_IGN runs no code of ours in a signal handler, and this
    // runs before the process starts a thread.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigIgn) };
}
