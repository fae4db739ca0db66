//! host-local's on-disk state for one network (`<dataDir>/<name>/`): one
//! file per held address, named after it as Go's `net.IP.String()` spells
//! it, holding `CONTAINER\r\nIFNAME` (or only `CONTAINER`, host-local's
//! legacy form); `last_reserved_ip.N` and `lock` are host-local's own.
//!
//! Only what host-local itself writes is read: a regular file with one
//! link, opened without following links or blocking on FIFOs; anything
//! else in the directory is refused by name, its content never echoed, so
//! a planted link to a secret neither leaks nor becomes a container id.

use std::cell::RefCell;
use std::fmt;
use std::fs::{File, Metadata, OpenOptions};
use std::io::{Read, Write};
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crate::cidr::Family;

/// host-local's line break inside an address file.
const LINE_BREAK: &str = "\r\n";

/// The interface recorded for legacy one-line files: host-local matched
/// them for any interface; Kubernetes runtimes always use `eth0`.
pub const LEGACY_IFNAME: &str = "eth0";

/// An address file is a container id and an interface name; anything
/// longer is not host-local's.
const MAX_FILE_BYTES: u64 = 4096;

/// Directory entries read at most: a network has at most as many files as
/// addresses, and no host-local range set is this large in practice.
const MAX_ENTRIES: usize = 1 << 20;

/// host-local's lock file inside the network's directory.
const LOCK_NAME: &str = "lock";

/// How long to wait for host-local's lock: host-local holds it for one
/// operation (milliseconds); a holder stuck longer fails the caller
/// ("try again") rather than stalling it for good.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// One address host-local records as held.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Held {
    pub address: IpAddr,
    pub container_id: String,
    pub ifname: String,
}

impl Held {
    /// Whether the file names this container and interface (a legacy file
    /// names the container only, and host-local matches it for any).
    pub fn names(&self, container_id: &str, ifname: &str) -> bool {
        self.container_id == container_id && self.ifname == ifname
    }
}

/// Why the directory could not be read or written.
#[derive(Debug, PartialEq, Eq)]
pub struct DirError(pub String);

impl fmt::Display for DirError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn io_error(what: &str, path: &Path, err: &std::io::Error) -> DirError {
    DirError(format!("{what} {}: {err}", path.display()))
}

/// Whether host-local owns a file of this name for itself.
fn is_bookkeeping(name: &str) -> bool {
    name == LOCK_NAME || name.starts_with("last_reserved_ip.")
}

/// The name host-local gives the file of `address`: Go's `net.IP.String()`,
/// i.e. dotted IPv4, and RFC 5952 for IPv6 (lower case, longest zero run
/// compressed) except that an IPv4-mapped address is spelled as IPv4.
pub fn file_name(address: IpAddr) -> String {
    match address {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => v6.to_string(),
        },
        IpAddr::V4(v4) => v4.to_string(),
    }
}

/// What a directory entry's name says: host-local's bookkeeping (`None`),
/// or the address of an address file. A name that is no address, or not
/// host-local's own spelling of its address (host-local looks files up by
/// that spelling only, so it would hand the address out again), is refused.
pub fn parse_name(name: &str) -> Result<Option<IpAddr>, String> {
    if is_bookkeeping(name) {
        return Ok(None);
    }
    let address: IpAddr = name
        .parse()
        .map_err(|_| "not an address file of host-local".to_string())?;
    let canonical = file_name(address);
    if canonical != name {
        return Err(format!(
            "not host-local's spelling of {address}: host-local names it {canonical:?} and would hand the address out again; rename the file to that name"
        ));
    }
    Ok(Some(address))
}

/// Parses an address file's content: `CONTAINER\r\nIFNAME`, or the legacy
/// `CONTAINER` alone. Surrounding whitespace is trimmed as host-local
/// trims it. The message never quotes the content: the file may be
/// something else than host-local's.
pub fn parse_entry(address: IpAddr, content: &[u8]) -> Result<Held, String> {
    let unexpected = || {
        format!(
            "{address}: not host-local's \"CONTAINER\\r\\nIFNAME\" ({} bytes, content not shown)",
            content.len()
        )
    };
    let text = std::str::from_utf8(content).map_err(|_| unexpected())?;
    let (container, ifname) = match text.split_once(LINE_BREAK) {
        Some((container, ifname)) => (container.trim(), ifname.trim()),
        None => (text.trim(), LEGACY_IFNAME),
    };
    let printable = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_graphic());
    if !printable(container) || !printable(ifname) {
        return Err(unexpected());
    }
    Ok(Held {
        address,
        container_id: container.to_string(),
        ifname: ifname.to_string(),
    })
}

/// What kind of thing other than a regular file `meta` describes.
fn odd_kind(meta: &Metadata) -> Option<&'static str> {
    let kind = meta.file_type();
    if kind.is_file() {
        return (meta.nlink() > 1).then_some("a file with several hard links");
    }
    Some(if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    })
}

fn refuse_odd(path: &Path, kind: &str) -> DirError {
    DirError(format!(
        "{}: is {kind}, not an address file of host-local; not read or followed (remove it if it is not yours)",
        path.display()
    ))
}

/// Whether the network's directory exists; refuses one that is a link or
/// not a directory: nothing is read from or written into where it points.
pub fn exists(dir: &Path) -> Result<bool, DirError> {
    match std::fs::symlink_metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(true),
        Ok(meta) => Err(refuse_odd(dir, odd_kind(&meta).unwrap_or("a file"))),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(io_error("cannot read", dir, &err)),
    }
}

/// The (device, inode) of the network's directory, if it exists: a
/// directory removed and created again is another one.
pub fn identity(dir: &Path) -> Result<Option<(u64, u64)>, DirError> {
    if !exists(dir)? {
        return Ok(None);
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| io_error("cannot read", dir, &e))?;
    Ok(Some((meta.dev(), meta.ino())))
}

/// Every held address of the directory, sorted by address. A missing
/// directory holds nothing. An entry that is neither an address file nor
/// host-local's bookkeeping, or whose content is not an owner, is an error
/// naming it: an import must not silently drop a pod.
pub fn read(dir: &Path) -> Result<Vec<Held>, DirError> {
    if !exists(dir)? {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| io_error("cannot read", dir, &e))?;
    let mut held = Vec::new();
    for (count, entry) in entries.enumerate() {
        if count >= MAX_ENTRIES {
            return Err(DirError(format!(
                "{} has more than {MAX_ENTRIES} entries",
                dir.display()
            )));
        }
        let entry = entry.map_err(|e| io_error("cannot read", dir, &e))?;
        let path = entry.path();
        let name = entry.file_name();
        let address = name
            .to_str()
            .ok_or_else(|| "not an address file of host-local".to_string())
            .and_then(parse_name)
            .map_err(|e| DirError(format!("{}: {e}", path.display())))?;
        let Some(address) = address else { continue };
        if let Some(entry) = read_address(dir, address)? {
            held.push(entry);
        }
    }
    held.sort();
    Ok(held)
}

/// The owner host-local's file records for `address`, if there is one
/// (a file removed meanwhile is none).
pub fn read_address(dir: &Path, address: IpAddr) -> Result<Option<Held>, DirError> {
    let path = path_of(dir, address);
    let Some(bytes) = read_small(&path)? else {
        return Ok(None);
    };
    parse_entry(address, &bytes)
        .map(Some)
        .map_err(|e| DirError(format!("{}: {e}", dir.display())))
}

/// The bytes of a small regular file, `None` when it does not exist. The
/// entry is judged by `lstat` before it is opened (a device is never
/// opened), opened without following a link and without blocking, and
/// must still be the same file once open.
fn read_small(path: &Path) -> Result<Option<Vec<u8>>, DirError> {
    let before = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(io_error("cannot read", path, &err)),
    };
    if let Some(kind) = odd_kind(&before) {
        return Err(refuse_odd(path, kind));
    }
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY)
        .open(path)
    {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) if err.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err(refuse_odd(path, "a symbolic link"));
        }
        Err(err) => return Err(io_error("cannot read", path, &err)),
    };
    let now = file
        .metadata()
        .map_err(|e| io_error("cannot read", path, &e))?;
    if (now.dev(), now.ino()) != (before.dev(), before.ino()) {
        return Err(DirError(format!(
            "{}: replaced while being read; run the command again",
            path.display()
        )));
    }
    if let Some(kind) = odd_kind(&now) {
        return Err(refuse_odd(path, kind));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error("cannot read", path, &e))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(DirError(format!(
            "{}: larger than {MAX_FILE_BYTES} bytes, not an address file of host-local; not read",
            path.display()
        )));
    }
    Ok(Some(bytes))
}

/// The file host-local keeps for `address` in `dir`.
pub fn path_of(dir: &Path, address: IpAddr) -> PathBuf {
    dir.join(file_name(address))
}

/// Creates the network's directory as host-local does (0755) when it is
/// missing; refuses one that is a link.
pub fn write_dir(dir: &Path) -> Result<(), DirError> {
    if exists(dir)? {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|e| io_error("cannot create", dir, &e))?;
    exists(dir).map(|_| ())
}

/// Writes `held` as host-local does (a new file, 0644, in a 0755 directory
/// created if missing), never through a link. Returns false, writing
/// nothing, when the file exists. [`sync`] makes it durable.
pub fn write(dir: &Path, held: &Held) -> Result<bool, DirError> {
    write_dir(dir)?;
    let path = path_of(dir, held.address);
    // O_EXCL creates the entry itself, never what a link there names.
    let mut file = match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
    {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
        Err(err) => return Err(io_error("cannot create", &path, &err)),
    };
    let content = format!("{}{LINE_BREAK}{}", held.container_id, held.ifname);
    if let Err(err) = file.write_all(content.as_bytes()) {
        let _ = std::fs::remove_file(&path);
        return Err(io_error("cannot write", &path, &err));
    }
    Ok(true)
}

/// Removes the file of `address` when it names this container and
/// interface; returns whether it did.
pub fn remove_owned(
    dir: &Path,
    address: IpAddr,
    container_id: &str,
    ifname: &str,
) -> Result<bool, DirError> {
    match read_address(dir, address)? {
        Some(held) if held.names(container_id, ifname) => {
            let path = path_of(dir, address);
            match std::fs::remove_file(&path) {
                Ok(()) => Ok(true),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
                Err(err) => Err(io_error("cannot remove", &path, &err)),
            }
        }
        _ => Ok(false),
    }
}

/// The entries of `dir` named like address files, with their paths (at
/// most [`MAX_ENTRIES`]); anything else is left for the caller to ignore.
fn address_files(dir: &Path) -> Result<Vec<(IpAddr, PathBuf)>, DirError> {
    if !exists(dir)? {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| io_error("cannot read", dir, &e))?;
    let mut files = Vec::new();
    for entry in entries.take(MAX_ENTRIES) {
        let entry = entry.map_err(|e| io_error("cannot read", dir, &e))?;
        if let Some(Ok(Some(address))) = entry.file_name().to_str().map(parse_name) {
            files.push((address, entry.path()));
        }
    }
    Ok(files)
}

/// Removes every file of `dir` naming this container and interface (of
/// `family` only, if given), as host-local's DEL does; entries that are not
/// host-local's are left alone. Returns the addresses released.
pub fn remove_all_owned(
    dir: &Path,
    container_id: &str,
    ifname: &str,
    family: Option<Family>,
) -> Result<Vec<IpAddr>, DirError> {
    let mut removed = Vec::new();
    for (address, _) in address_files(dir)? {
        if family.is_some_and(|f| f != Family::of(address)) {
            continue;
        }
        if let Ok(true) = remove_owned(dir, address, container_id, ifname) {
            removed.push(address);
        }
    }
    Ok(removed)
}

/// Removes every address file of `dir` whose owner `keep` does not name
/// and that was last written at or before `written_until` (a younger one
/// may be an ADD still in flight), as a CNI GC of host-local does; entries
/// that are not host-local's are left alone. Returns the addresses released.
pub fn remove_unkept(
    dir: &Path,
    keep: &dyn Fn(&str, &str) -> bool,
    written_until: SystemTime,
) -> Result<Vec<IpAddr>, DirError> {
    let mut removed = Vec::new();
    for (address, path) in address_files(dir)? {
        let young = std::fs::symlink_metadata(path)
            .and_then(|meta| meta.modified())
            .map_or(true, |written| written > written_until);
        if young {
            continue;
        }
        let Ok(Some(held)) = read_address(dir, address) else {
            continue;
        };
        if keep(&held.container_id, &held.ifname) {
            continue;
        }
        if let Ok(true) = remove_owned(dir, address, &held.container_id, &held.ifname) {
            removed.push(address);
        }
    }
    Ok(removed)
}

/// Makes everything written under `dir` durable with one `syncfs`: a
/// thousand files synced one by one take seconds.
pub fn sync(dir: &Path) -> Result<(), DirError> {
    let handle = File::open(dir).map_err(|e| io_error("cannot open", dir, &e))?;
    nix::unistd::syncfs(&handle).map_err(|e| io_error("cannot sync", dir, &std::io::Error::from(e)))
}

thread_local! {
    /// The directories whose lock this thread holds: `flock` locks belong
    /// to an open file, so taking it again through another open would wait
    /// on ourselves.
    static LOCKED: RefCell<Vec<PathBuf>> = const { RefCell::new(Vec::new()) };
}

/// host-local's own lock of a network's directory (`DIR/lock`, `flock`
/// exclusive, the lock host-local takes for each of its operations), held
/// until dropped. Taken again by the thread that holds it, it is the same
/// lock.
#[derive(Debug)]
pub struct Lock {
    held: Option<(PathBuf, nix::fcntl::Flock<File>)>,
}

impl Lock {
    /// Takes the lock of `dir` (which must exist), waiting at most
    /// [`LOCK_WAIT`] for host-local to finish its operation.
    pub fn take(dir: &Path) -> Result<Lock, DirError> {
        if LOCKED.with(|locked| locked.borrow().iter().any(|d| d == dir)) {
            return Ok(Lock { held: None });
        }
        let path = dir.join(LOCK_NAME);
        let mut file = OpenOptions::new()
            .read(true)
            .create(true)
            .append(true)
            .mode(0o644)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(nix::libc::ELOOP) => refuse_odd(&path, "a symbolic link"),
                _ => io_error("cannot open", &path, &e),
            })?;
        let meta = file
            .metadata()
            .map_err(|e| io_error("cannot read", &path, &e))?;
        if !meta.is_file() {
            return Err(refuse_odd(&path, odd_kind(&meta).unwrap_or("odd")));
        }
        let deadline = Instant::now() + LOCK_WAIT;
        let mut pause = Duration::from_millis(1);
        loop {
            match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(locked) => {
                    LOCKED.with(|held| held.borrow_mut().push(dir.to_path_buf()));
                    return Ok(Lock {
                        held: Some((dir.to_path_buf(), locked)),
                    });
                }
                Err((back, nix::errno::Errno::EWOULDBLOCK)) if Instant::now() < deadline => {
                    file = back;
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err((_, errno)) => {
                    return Err(DirError(format!(
                        "cannot take host-local's lock {}: {}",
                        path.display(),
                        if errno == nix::errno::Errno::EWOULDBLOCK {
                            format!("held by another process for {LOCK_WAIT:?}")
                        } else {
                            errno.to_string()
                        }
                    )));
                }
            }
        }
    }
}

impl Lock {
    /// Takes the lock of `dir` only if host-local's lock file is there
    /// (creating nothing): for a run that only reads.
    pub fn take_if_present(dir: &Path) -> Result<Option<Lock>, DirError> {
        let path = dir.join(LOCK_NAME);
        match std::fs::symlink_metadata(&path) {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            _ => Lock::take(dir).map(Some),
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        if let Some((dir, _)) = &self.held {
            LOCKED.with(|locked| locked.borrow_mut().retain(|d| d != dir));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn entries_current_legacy_and_malformed() {
        let held = |c: &str, i: &str| Held {
            address: ip("198.18.0.2"),
            container_id: c.into(),
            ifname: i.into(),
        };
        assert_eq!(
            parse_entry(ip("198.18.0.2"), b"abc\r\nnet1"),
            Ok(held("abc", "net1"))
        );
        assert_eq!(
            parse_entry(ip("198.18.0.2"), b" abc \n"),
            Ok(held("abc", "eth0"))
        );
        for bad in [
            &b""[..],
            b"\r\neth0",
            b"abc\r\n",
            b"a b\r\neth0",
            b"abc\r\neth\x000",
            b"root:$6$secret:1\xff",
        ] {
            let err = parse_entry(ip("198.18.0.2"), bad).unwrap_err();
            assert!(err.contains("content not shown"), "{err}");
            assert!(!err.contains("secret") && !err.contains("abc"), "{err}");
        }
    }

    #[test]
    fn names_are_host_locals_spelling_only() {
        for (name, want) in [
            ("198.18.0.9", Ok(Some(ip("198.18.0.9")))),
            ("2001:db8:11::5", Ok(Some(ip("2001:db8:11::5")))),
            ("lock", Ok(None)),
            ("last_reserved_ip.0", Ok(None)),
        ] {
            assert_eq!(parse_name(name), want, "{name}");
        }
        for name in [
            "2001:DB8:11::5",
            "2001:db8:11:0:0:0:0:5",
            "2001:db8:0011::5",
            "::ffff:198.18.0.9",
        ] {
            let err = parse_name(name).unwrap_err();
            assert!(err.contains("not host-local's spelling"), "{name}: {err}");
        }
        assert!(parse_name("notes.txt").is_err());
        assert_eq!(file_name(ip("::ffff:198.18.0.9")), "198.18.0.9");
        assert_eq!(file_name(ip("2001:db8:0:0:1:0:0:1")), "2001:db8::1:0:0:1");
    }

    #[test]
    fn reads_what_it_writes_and_refuses_strangers() {
        let dir = crate::testutil::TempDir::new();
        let net = dir.0.join("net");
        assert_eq!(read(&net), Ok(Vec::new()));
        let a = Held {
            address: ip("2001:db8::5"),
            container_id: "c2".into(),
            ifname: "eth0".into(),
        };
        let b = Held {
            address: ip("198.18.0.9"),
            container_id: "c1".into(),
            ifname: "net1".into(),
        };
        assert_eq!(write(&net, &a), Ok(true));
        assert_eq!(write(&net, &b), Ok(true));
        assert_eq!(write(&net, &b), Ok(false), "an existing file is kept");
        std::fs::write(net.join("last_reserved_ip.0"), "198.18.0.9").unwrap();
        std::fs::write(net.join("lock"), "").unwrap();
        assert_eq!(read(&net), Ok(vec![b.clone(), a.clone()]));
        assert_eq!(remove_owned(&net, b.address, "c1", "eth0"), Ok(false));
        assert_eq!(remove_owned(&net, b.address, "c1", "net1"), Ok(true));
        assert_eq!(read(&net), Ok(vec![a.clone()]));
        std::fs::write(net.join("notes.txt"), "x").unwrap();
        assert!(
            read(&net)
                .unwrap_err()
                .0
                .ends_with("notes.txt: not an address file of host-local")
        );
        std::fs::remove_file(net.join("notes.txt")).unwrap();
        std::fs::write(net.join("198.18.0.7"), vec![b'x'; 5000]).unwrap();
        assert!(read(&net).unwrap_err().0.contains("larger than 4096 bytes"));
    }

    #[test]
    fn the_lock_is_reentrant_in_a_thread_and_exclusive_across_opens() {
        let dir = crate::testutil::TempDir::new();
        let outer = Lock::take(&dir.0).unwrap();
        let inner = Lock::take(&dir.0).unwrap();
        drop(inner);
        // Another open file (as host-local's) cannot take it meanwhile.
        let other = File::open(dir.0.join("lock")).unwrap();
        let busy = nix::fcntl::Flock::lock(other, nix::fcntl::FlockArg::LockExclusiveNonblock);
        assert!(busy.is_err());
        drop(outer);
        let other = File::open(dir.0.join("lock")).unwrap();
        assert!(
            nix::fcntl::Flock::lock(other, nix::fcntl::FlockArg::LockExclusiveNonblock).is_ok()
        );
    }
}
