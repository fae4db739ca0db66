//! host-local's on-disk state for one network (`<dataDir>/<name>/`): one
//! file per held address, named after it, holding `CONTAINER\r\nIFNAME`
//! (or only `CONTAINER`, host-local's legacy form); `last_reserved_ip.N`
//! and `lock` are host-local's own and ignored here.

use std::fmt;
use std::io::{Read, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

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

/// One address host-local records as held.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Held {
    pub address: IpAddr,
    pub container_id: String,
    pub ifname: String,
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
    name == "lock" || name.starts_with("last_reserved_ip.")
}

/// Parses an address file's content: `CONTAINER\r\nIFNAME`, or the legacy
/// `CONTAINER` alone. Surrounding whitespace is trimmed as host-local
/// trims it.
pub fn parse_entry(address: IpAddr, content: &str) -> Result<Held, String> {
    let (container, ifname) = match content.split_once(LINE_BREAK) {
        Some((container, ifname)) => (container.trim(), ifname.trim()),
        None => (content.trim(), LEGACY_IFNAME),
    };
    let printable = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_graphic());
    if !printable(container) || !printable(ifname) {
        return Err(format!(
            "{address}: expected \"CONTAINER\\r\\nIFNAME\", found {content:?}"
        ));
    }
    Ok(Held {
        address,
        container_id: container.to_string(),
        ifname: ifname.to_string(),
    })
}

/// Every held address of the directory, sorted by address. A missing
/// directory holds nothing. A file that is neither an address nor
/// host-local's bookkeeping, or whose content is not an owner, is an
/// error naming it: an import must not silently drop a pod.
pub fn read(dir: &Path) -> Result<Vec<Held>, DirError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(io_error("cannot read", dir, &err)),
    };
    let mut held = Vec::new();
    for (count, entry) in entries.enumerate() {
        if count >= MAX_ENTRIES {
            return Err(DirError(format!(
                "{} has more than {MAX_ENTRIES} entries",
                dir.display()
            )));
        }
        let entry = entry.map_err(|e| io_error("cannot read", dir, &e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_bookkeeping(&name) {
            continue;
        }
        let path = entry.path();
        let address: IpAddr = name.parse().map_err(|_| {
            DirError(format!(
                "{}: not an address file of host-local",
                path.display()
            ))
        })?;
        let content = read_small(&path)?;
        held.push(
            parse_entry(address, &content)
                .map_err(|e| DirError(format!("{}: {e}", dir.display())))?,
        );
    }
    held.sort();
    Ok(held)
}

fn read_small(path: &Path) -> Result<String, DirError> {
    let file = std::fs::File::open(path).map_err(|e| io_error("cannot read", path, &e))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error("cannot read", path, &e))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(DirError(format!(
            "{}: larger than {MAX_FILE_BYTES} bytes, not an address file",
            path.display()
        )));
    }
    String::from_utf8(bytes).map_err(|_| DirError(format!("{}: not UTF-8", path.display())))
}

/// The file host-local would keep for `held` in `dir`.
pub fn path_of(dir: &Path, address: IpAddr) -> PathBuf {
    dir.join(address.to_string())
}

/// Writes `held` as host-local does (a new file, 0644, in a 0755
/// directory created if missing). The file must not exist; [`sync`]
/// makes it durable.
pub fn write(dir: &Path, held: &Held) -> Result<(), DirError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|e| io_error("cannot create", dir, &e))?;
    let path = path_of(dir, held.address);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&path)
        .map_err(|e| io_error("cannot create", &path, &e))?;
    let content = format!("{}{LINE_BREAK}{}", held.container_id, held.ifname);
    file.write_all(content.as_bytes())
        .map_err(|e| io_error("cannot write", &path, &e))
}

/// Makes everything written under `dir` durable with one `syncfs`: a
/// thousand files synced one by one take seconds.
pub fn sync(dir: &Path) -> Result<(), DirError> {
    let handle = std::fs::File::open(dir).map_err(|e| io_error("cannot open", dir, &e))?;
    nix::unistd::syncfs(&handle).map_err(|e| io_error("cannot sync", dir, &std::io::Error::from(e)))
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
            parse_entry(ip("198.18.0.2"), "abc\r\nnet1"),
            Ok(held("abc", "net1"))
        );
        assert_eq!(
            parse_entry(ip("198.18.0.2"), " abc \n"),
            Ok(held("abc", "eth0"))
        );
        for bad in ["", "\r\neth0", "abc\r\n", "a b\r\neth0", "abc\r\neth\u{0}0"] {
            assert!(parse_entry(ip("198.18.0.2"), bad).is_err(), "{bad:?}");
        }
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
        write(&net, &a).unwrap();
        write(&net, &b).unwrap();
        assert!(
            write(&net, &b).is_err(),
            "an existing file is never overwritten"
        );
        std::fs::write(net.join("last_reserved_ip.0"), "198.18.0.9").unwrap();
        std::fs::write(net.join("lock"), "").unwrap();
        assert_eq!(read(&net), Ok(vec![b.clone(), a.clone()]));
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
}
