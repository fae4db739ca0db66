//! The Rust types in `src/wire/gen/` are generated from `proto/` and
//! committed, so building Metis needs neither protoc nor network access.
//! This test regenerates them with a pure-Rust protobuf compiler and fails if
//! the committed files differ; `make proto` (METIS_WRITE_PROTO=1) rewrites them.

use std::fs;
use std::path::Path;

const PROTO_FILES: &[&str] = &[
    "adaptiveipam/v1/adaptiveipam.proto",
    "admin/v1/admin.proto",
    "metis/v1/envelope.proto",
];

#[test]
fn generated_wire_types_match_proto_sources() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let descriptors = protox::compile(PROTO_FILES, [root.join("proto")])
        .unwrap_or_else(|err| panic!("proto/ does not compile: {err}"));
    let out = std::env::temp_dir().join(format!("metis-proto-{}", std::process::id()));
    fs::create_dir_all(&out).unwrap();
    prost_build::Config::new()
        .out_dir(&out)
        .compile_fds(descriptors)
        .unwrap();

    let committed = root.join("src/wire/gen");
    let write = std::env::var_os("METIS_WRITE_PROTO").is_some();
    let mut stale = Vec::new();
    let mut names: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "unexpected generated files: {names:?}");
    for name in names {
        let fresh = fs::read_to_string(out.join(&name)).unwrap();
        let path = committed.join(&name);
        if write {
            fs::write(&path, &fresh).unwrap();
        } else if fs::read_to_string(&path).ok().as_deref() != Some(fresh.as_str()) {
            stale.push(path.display().to_string());
        }
    }
    fs::remove_dir_all(&out).unwrap();
    assert!(
        stale.is_empty(),
        "generated wire types are stale, run `make proto`: {stale:?}"
    );
}
