//! A tmpfs of its own for tests of storage faults (mounting needs root).

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
