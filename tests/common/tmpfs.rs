//! A tmpfs of its own for tests of storage faults (mounting needs root).

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use super::TestDir;

/// A tmpfs mounted on a fresh directory, unmounted and removed on drop.
pub struct Tmpfs {
    pub dir: TestDir,
}

impl Tmpfs {
    pub fn mount(name: &str, size: &str) -> Tmpfs {
        let dir = TestDir::new(name);
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(&dir.path)
            .status()
            .unwrap();
        assert!(status.success(), "mount tmpfs (these tests need root)");
        Tmpfs { dir }
    }

    /// Fills the file system until a write fails with ENOSPC, with the
    /// file `name`; its path.
    pub fn fill(&self, name: &str) -> PathBuf {
        let path = self.dir.join(name);
        let mut file = std::fs::File::create(&path).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(err) => {
                    assert_eq!(err.raw_os_error(), Some(28), "{err}"); // ENOSPC
                    break;
                }
            }
        }
        // Byte by byte, so not even a page is left.
        while file.write(&[0]).is_ok_and(|n| n == 1) {}
        path
    }

    pub fn remount(&self, option: &str) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,{option}")])
            .arg(&self.dir.path)
            .status()
            .unwrap();
        assert!(status.success(), "remount {option}");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy, so a process still holding a file cannot keep it mounted;
        // the TestDir then removes the directory.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.dir.path)
            .status();
    }
}
