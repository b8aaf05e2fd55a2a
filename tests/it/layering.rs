//! The modules of `src/` form layers: no module may reach back into one that depends on it.
//! Between top-level modules this reads every `crate::<module>` path outside comments; inside
//! each top-level folder module, every path to a sibling (`super::<child>`, `crate::<top>::
//! <child>`, or an item its `mod.rs` re-exports from a child). Either graph with a cycle fails
//! the test, naming the cycle. (Not a full Rust parser: a path in a string literal would count
//! too, which errs on the side of failing. A folder's `mod.rs` is not a node: it declares and
//! re-exports its children.)

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

/// The code of a source file with `//` comments cut off.
fn code_lines(text: &str) -> Vec<&str> {
    text.lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect()
}

/// The identifiers of a path list such as `a::{B, c::D}` or `E;`, up to its end.
fn path_idents(tail: &str) -> Vec<String> {
    let tail = tail.trim_start();
    let end = if tail.starts_with('{') {
        tail.find('}').map_or(tail.len(), |e| e + 1)
    } else {
        tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len())
    };
    tail[..end]
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Per top-level folder module of `src`, the graph of its children (files and folders beside
/// its `mod.rs`) by the siblings each names.
fn child_graphs(src: &Path) -> BTreeMap<String, Graph> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("read src") {
        let dir = entry.expect("entry").path();
        let Some(top) = dir.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
            continue;
        };
        if !dir.is_dir() || top == "bin" {
            continue;
        }
        let children: BTreeSet<String> = std::fs::read_dir(&dir)
            .expect("read module dir")
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                (name != "mod.rs").then(|| name.trim_end_matches(".rs").to_owned())
            })
            .collect();
        // Items `mod.rs` re-exports, by the child they come from.
        let mut reexported: BTreeMap<String, String> = BTreeMap::new();
        if let Ok(text) = std::fs::read_to_string(dir.join("mod.rs")) {
            let code = code_lines(&text).join("\n");
            for (at, _) in code.match_indices("use ") {
                let rest = &code[at + 4..];
                let Some((child, tail)) = rest.split_once("::") else {
                    continue;
                };
                if children.contains(child.trim()) {
                    for item in path_idents(tail) {
                        reexported
                            .entry(item)
                            .or_insert_with(|| child.trim().to_owned());
                    }
                }
            }
        }
        let resolve = |name: &str| -> Option<String> {
            if children.contains(name) {
                Some(name.to_owned())
            } else {
                reexported.get(name).cloned()
            }
        };
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        let mut graph: Graph = children
            .iter()
            .map(|c| (c.clone(), BTreeSet::new()))
            .collect();
        for file in files {
            let relative: Vec<String> = file
                .strip_prefix(&dir)
                .expect("under the module")
                .components()
                .filter_map(|c| c.as_os_str().to_str().map(str::to_owned))
                .collect();
            if relative == ["mod.rs"] {
                continue;
            }
            let child = relative[0].trim_end_matches(".rs").to_owned();
            // How many `super::` lead from this file to the folder module.
            let depth = if relative.len() == 2 && relative[1] == "mod.rs" {
                1
            } else {
                relative.len()
            };
            let to_parent = "super::".repeat(depth);
            let by_crate = format!("crate::{top}::");
            let text = std::fs::read_to_string(&file).expect("read source");
            let mut named = BTreeSet::new();
            for code in code_lines(&text) {
                for prefix in [to_parent.as_str(), by_crate.as_str()] {
                    for (at, _) in code.match_indices(prefix) {
                        // `super::super::x` seen from a `super::` prefix is not this depth.
                        let before = &code[..at];
                        if before.ends_with("super::")
                            || before.ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                        {
                            continue;
                        }
                        let tail = &code[at + prefix.len()..];
                        let idents = path_idents(tail);
                        // `a::b`: only the first segment names the sibling; `{a, b::c}`: each
                        // first segment does.
                        if tail.trim_start().starts_with('{') {
                            let inner = tail.trim_start().trim_start_matches('{');
                            let inner = inner.split('}').next().unwrap_or_default();
                            for part in inner.split(',') {
                                if let Some(first) = path_idents(part).first() {
                                    named.insert(first.clone());
                                }
                            }
                        } else if let Some(first) = idents.first() {
                            named.insert(first.clone());
                        }
                    }
                }
            }
            let uses = graph.entry(child.clone()).or_default();
            for name in named {
                if let Some(sibling) = resolve(&name).filter(|s| *s != child) {
                    uses.insert(sibling);
                }
            }
        }
        out.insert(top, graph);
    }
    out
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
fn the_children_of_each_module_have_no_cycle() {
    let graphs = child_graphs(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let kvcache = graphs.get("kvcache").expect("kvcache is a folder module");
    assert!(
        kvcache
            .get("matching")
            .is_some_and(|uses| uses.contains("index")),
        "the scan sees sibling paths: {kvcache:?}"
    );
    for (top, graph) in &graphs {
        if let Some(cycle) = find_cycle(graph) {
            panic!("module cycle inside {top}: {}", cycle.join(" → "));
        }
    }
}

#[test]
fn a_planted_child_cycle_is_found() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    std::fs::create_dir_all(src.join("top/deep")).unwrap();
    std::fs::write(
        src.join("top/mod.rs"),
        "mod a; mod b; mod deep;\npub use a::Alpha;\npub use b::{Beta, Gamma};\n",
    )
    .unwrap();
    std::fs::write(
        src.join("top/a.rs"),
        "use super::b::Beta;\npub struct Alpha;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("top/b.rs"),
        "// super::a in a comment\npub struct Beta; pub struct Gamma;\n",
    )
    .unwrap();
    std::fs::write(src.join("top/deep/mod.rs"), "mod inner;\n").unwrap();
    std::fs::write(
        src.join("top/deep/inner.rs"),
        "use super::super::Gamma;\nuse super::x;\n",
    )
    .unwrap();
    let graphs = child_graphs(src);
    assert_eq!(find_cycle(&graphs["top"]), None, "{:?}", graphs["top"]);
    assert!(
        graphs["top"]["deep"].contains("b"),
        "a re-exported item names its child"
    );
    // b reaches back to a through the re-export.
    std::fs::write(
        src.join("top/b.rs"),
        "use super::Alpha;\npub struct Beta; pub struct Gamma;\n",
    )
    .unwrap();
    let cycle = find_cycle(&child_graphs(src)["top"]).expect("the planted cycle");
    assert!(
        cycle.contains(&"a".to_owned()) && cycle.contains(&"b".to_owned()),
        "{cycle:?}"
    );
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
