//! The top-level modules of `src/` form layers: no module may reach back into one that
//! depends on it. This reads every `crate::<module>` path outside comments, builds the graph
//! of top-level modules, and fails on any cycle, naming it. (Not a full Rust parser: a path in
//! a string literal would count too, which errs on the side of failing.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module → the top-level modules its code names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module graph of the crate whose sources are in `src`.
fn module_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = Graph::new();
    for file in files {
        let relative = file.strip_prefix(src).expect("under src");
        let first = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .expect("a first component");
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "lib" || module == "main" || module == "bin" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read source");
        let uses = graph.entry(module.clone()).or_default();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or_default();
            for (at, _) in code.match_indices("crate::") {
                let target: String = code[at + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !target.is_empty() && target != module {
                    uses.insert(target);
                }
            }
        }
    }
    graph
}

/// One cycle of `graph`, as the modules along it, if there is any.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_top_level_modules_have_no_cycle() {
    let graph = module_graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(graph.len() > 5, "found too few modules: {graph:?}");
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "module cycle: {} (each names the next through `crate::`)",
            cycle.join(" → ")
        );
    }
}

#[test]
fn a_planted_cycle_is_found() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    std::fs::create_dir_all(src.join("low")).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "pub mod low; pub mod high; pub mod other;",
    )
    .unwrap();
    std::fs::write(
        src.join("low/mod.rs"),
        "//! uses crate::high in a comment only\npub fn f() {}\n",
    )
    .unwrap();
    std::fs::write(src.join("high.rs"), "use crate::low::f;\n").unwrap();
    std::fs::write(src.join("other.rs"), "use crate::high;\n").unwrap();
    assert_eq!(
        find_cycle(&module_graph(src)),
        None,
        "comments do not count"
    );

    std::fs::write(
        src.join("low/inner.rs"),
        "fn g() { crate::high::h(); } // low reaches up\n",
    )
    .unwrap();
    let cycle = find_cycle(&module_graph(src)).expect("the planted cycle");
    assert_eq!(cycle.first(), cycle.last());
    assert!(cycle.contains(&"low".to_owned()) && cycle.contains(&"high".to_owned()));
}
