//! The device headers are discovered, not listed: every `.cuh` under `templates/include/` is
//! in `HEADERS` (build.rs), and the generated `codecs.cuh` includes every codec header.

use std::path::Path;

fn on_disk(dir: &Path, root: &Path, out: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            on_disk(&p, root, out);
        } else if p.extension().is_some_and(|x| x == "cuh") {
            out.push(p.strip_prefix(root).unwrap().to_str().unwrap().replace('\\', "/"));
        }
    }
}

#[test]
fn every_header_on_disk_is_embedded_once_in_path_order() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../templates/include");
    let mut disk = Vec::new();
    on_disk(&root, &root, &mut disk);
    disk.sort();
    let listed: Vec<String> = kvforge_gen::HEADERS.iter().map(|(p, _)| p.to_string()).collect();
    assert_eq!(listed, disk);
    for (p, s) in kvforge_gen::HEADERS {
        assert_eq!(*s, std::fs::read_to_string(root.join(p)).unwrap(), "{p} is stale: build.rs did not rerun");
    }
}

#[test]
fn codecs_cuh_includes_every_codec_header_base_first() {
    let text = kvforge_gen::render_codecs_cuh();
    let includes: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("#include \"")).map(|l| l.trim_end_matches('"')).collect();
    let mut codecs: Vec<&str> = kvforge_gen::HEADERS.iter().map(|(p, _)| *p).filter(|p| p.starts_with(kvforge_gen::CODECS_DIR)).collect();
    assert!(codecs.len() >= 6, "{codecs:?}");
    assert_eq!(includes[0], "kvforge/codecs/base.cuh");
    codecs.retain(|p| *p != includes[0]);
    assert_eq!(&includes[1..], &codecs[..]);
    let all = kvforge_gen::all_headers();
    assert_eq!(all.iter().filter(|(p, _)| p == "kvforge/codecs.cuh").count(), 1);
    assert!(all.iter().any(|(p, s)| p == "kvforge/codecs.cuh" && *s == text));
}
