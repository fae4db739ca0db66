//! The database's file modes. Metis creates its directory 0700 and the
//! database 0600; files that already exist (an older version, a copy made
//! by hand) are brought back to 0600 on open. A directory that exists is
//! only reported, never changed: it may be shared (`/var/lib`, `/tmp`).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Mode bits that give group or others any access.
const SHARED_BITS: u32 = 0o077;

/// Tightens the database file and its WAL companions to 0600 where group or
/// others have access, and returns a warning for each file that could not
/// be tightened and for a parent directory others may enter.
pub fn tighten(db: &Path) -> Vec<String> {
    let mut warnings = Vec::new();
    for path in [
        db.to_path_buf(),
        companion(db, "-wal"),
        companion(db, "-shm"),
    ] {
        let Ok(meta) = fs::metadata(&path) else {
            continue;
        };
        let mode = meta.permissions().mode() & 0o7777;
        if mode & SHARED_BITS == 0 {
            continue;
        }
        let private = fs::Permissions::from_mode(mode & !SHARED_BITS);
        if let Err(err) = fs::set_permissions(&path, private) {
            warnings.push(format!(
                "{} has mode {mode:04o} and could not be made private: {err}",
                path.display()
            ));
        }
    }
    let parent = db.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = parent
        && let Ok(meta) = fs::metadata(dir)
        && meta.permissions().mode() & SHARED_BITS != 0
    {
        warnings.push(format!(
            "the database directory {} has mode {:04o}; 0700 keeps the database private \
             (left as is: the directory may be shared)",
            dir.display(),
            meta.permissions().mode() & 0o7777
        ));
    }
    warnings
}

pub(in crate::store) fn companion(db: &Path, suffix: &str) -> PathBuf {
    let mut name = db.as_os_str().to_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn shared_files_become_private_and_shared_directories_are_reported() {
        let dir = TempDir::new();
        let db = dir.db();
        let parent = db.parent().unwrap().to_path_buf();
        for path in [db.clone(), companion(&db, "-wal")] {
            fs::write(&path, b"").unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        }
        fs::set_permissions(&parent, fs::Permissions::from_mode(0o700)).unwrap();
        assert!(tighten(&db).is_empty());
        assert_eq!(mode(&db), 0o600);
        assert_eq!(mode(&companion(&db, "-wal")), 0o600);

        fs::set_permissions(&parent, fs::Permissions::from_mode(0o755)).unwrap();
        let warnings = tighten(&db);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("has mode 0755"), "{warnings:?}");
        assert_eq!(mode(&parent), 0o755, "a directory is never changed");
        fs::set_permissions(&parent, fs::Permissions::from_mode(0o700)).unwrap();
    }
}
