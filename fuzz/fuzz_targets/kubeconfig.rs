//! Kubeconfig files: any text is a configuration or a clear error, never a
//! panic; a configuration names an http(s) server without a trailing slash.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use metis::kube::config::kubeconfig_from_text;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Files it names resolve under a directory that does not exist.
    if let Ok(config) = kubeconfig_from_text(text, Path::new("/nonexistent/metis-fuzz")) {
        assert!(config.server.starts_with("https://") || config.server.starts_with("http://"));
        assert!(!config.server.ends_with('/'));
    }
});
