//! The file-level import graph of `src/`, for the layering tests.
//!
//! A file imports another when one of its paths (`use crate::..`, `super::..`, `self::..`,
//! in a `use` tree or inline in the code) resolves, by its longest module prefix, to the
//! other file. Inline modules (`mod tests { .. }`, `mod avx2 { .. }`) resolve `super` and
//! `self` from where they stand; comments, strings and char literals are skipped; a
//! `mod x;` declaration is not an import (a parent only declares its children). This is a
//! reading of the text, not rustc's name resolution, so it errs on the side of an edge: a
//! path through a module counts even where only an item it re-exports is used.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The files of `src/` (relative paths such as `model/card.rs`) and who imports whom.
pub struct Graph {
    /// Every source file, relative to `src/`.
    pub files: Vec<String>,
    /// `edges[a]` holds the files `a` imports (never `a` itself, never `lib.rs`).
    pub edges: BTreeMap<String, BTreeSet<String>>,
}

/// Reads `src/` and builds the graph.
pub fn graph() -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut texts = BTreeMap::new();
    let mut dirs = vec![root.clone()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(&root).unwrap().display().to_string();
                texts.insert(rel, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let modules: BTreeMap<Vec<String>, String> =
        texts.keys().map(|f| (module_of(f), f.clone())).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, text) in &texts {
        let mut found = Vec::new();
        paths_in(&clean(text), &module_of(file), &modules, &mut found);
        for segs in found {
            let target = (1..=segs.len()).rev().find_map(|n| modules.get(&segs[..n]));
            if let Some(t) = target {
                if t != file && t != "lib.rs" {
                    edges.entry(file.clone()).or_default().insert(t.clone());
                }
            }
        }
    }
    Graph {
        files: texts.into_keys().collect(),
        edges,
    }
}

impl Graph {
    /// The strongly connected sets of more than one file (each sorted), largest first.
    pub fn cycles(&self) -> Vec<Vec<String>> {
        let mut g = petgraph::graph::DiGraph::<&str, ()>::new();
        let index: BTreeMap<&str, _> = self
            .files
            .iter()
            .map(|f| (f.as_str(), g.add_node(f.as_str())))
            .collect();
        for (a, bs) in &self.edges {
            for b in bs {
                g.add_edge(index[a.as_str()], index[b.as_str()], ());
            }
        }
        let mut sets: Vec<Vec<String>> = petgraph::algo::tarjan_scc(&g)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|c| {
                let mut names: Vec<String> = c.iter().map(|&n| g[n].to_string()).collect();
                names.sort();
                names
            })
            .collect();
        sets.sort_by_key(|c| std::cmp::Reverse(c.len()));
        sets
    }

    /// The imports (`a -> b`) of files under the top-level module `from` into files under
    /// the top-level module `to`.
    pub fn imports_between(&self, from: &str, to: &str) -> Vec<String> {
        self.edges
            .iter()
            .filter(|(a, _)| top(a) == from)
            .flat_map(|(a, bs)| {
                bs.iter()
                    .filter(|b| top(b) == to)
                    .map(move |b| format!("{a} -> {b}"))
            })
            .collect()
    }
}

/// The top-level module a file belongs to (`model` for `model/card.rs`, `rng` for `rng.rs`).
pub fn top(file: &str) -> &str {
    file.split('/')
        .next()
        .unwrap_or(file)
        .trim_end_matches(".rs")
}

/// `model/family/mod.rs` -> `[model, family]`; `lib.rs` and `main.rs` -> `[]`.
fn module_of(file: &str) -> Vec<String> {
    let mut segs: Vec<String> = file
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_string)
        .collect();
    if segs.last().is_some_and(|s| s == "mod") {
        segs.pop();
    }
    if segs == ["lib"] || segs == ["main"] {
        segs.clear();
    }
    segs
}

/// The text with comments removed and string and char literals emptied.
fn clean(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |j| j + 2);
        } else if b[i] == b'r'
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
            && rest[1..].trim_start_matches('#').starts_with('"')
        {
            let hashes = rest[1..].len() - rest[1..].trim_start_matches('#').len();
            let end = format!("\"{}", "#".repeat(hashes));
            let body = &rest[2 + hashes..];
            i += 2 + hashes + body.find(&end).map_or(body.len(), |j| j + end.len());
            out.push_str("\"\"");
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            i = j + 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}'); a lifetime has no closing quote nearby.
            let close = if rest[1..].starts_with('\\') {
                rest[2..].find('\'').map(|j| j + 2)
            } else {
                rest[1..].chars().next().and_then(|c| {
                    let n = 1 + c.len_utf8();
                    rest[n..].starts_with('\'').then_some(n)
                })
            };
            match close {
                Some(j) if j < 12 => {
                    i += j + 1;
                    out.push_str("' '");
                }
                _ => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Collects the absolute module paths `text` (standing in module `here`) names: paths from
/// `crate`, `super` and `self`, and paths that start with a child module of `here` (Rust
/// 2018's relative paths, `use fields::Fields;` in a `mod.rs`).
fn paths_in(
    text: &str,
    here: &[String],
    modules: &BTreeMap<Vec<String>, String>,
    found: &mut Vec<Vec<String>>,
) {
    let mut outside = String::new();
    let mut i = 0;
    while let Some((start, name, open)) = next_inline_mod(text, i) {
        outside.push_str(&text[i..start]);
        let mut depth = 0usize;
        let mut close = text.len();
        for (j, c) in text[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let mut inner = here.to_vec();
        inner.push(name);
        paths_in(&text[(open + 1).min(close)..close], &inner, modules, found);
        i = (close + 1).min(text.len());
    }
    outside.push_str(&text[i..]);
    let mut raw: Vec<Vec<String>> = Vec::new();
    let mut rest = outside.as_str();
    while let Some(p) = find_word(rest, "use") {
        let tail = rest[p + 3..].trim_start();
        let tree = &tail[..tail.find(';').unwrap_or(tail.len())];
        if ["crate", "super", "self"]
            .iter()
            .any(|r| tree.starts_with(r))
        {
            let folded = tree.split_whitespace().collect::<Vec<_>>().join(" ");
            let marked = folded.replace(" as ", "@").replace(' ', "");
            expand(&marked, &mut Vec::new(), &mut raw);
        }
        rest = &rest[p + 3..];
    }
    for root in ["crate", "super", "self"] {
        let mut rest = outside.as_str();
        while let Some(p) = find_word(rest, root) {
            let mut segs = vec![root.to_string()];
            let mut tail = &rest[p + root.len()..];
            while let Some(t) = tail.trim_start().strip_prefix("::") {
                let t = t.trim_start();
                let len = t
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap_or(t.len());
                if len == 0 {
                    break;
                }
                segs.push(t[..len].to_string());
                tail = &t[len..];
            }
            if segs.len() > 1 {
                raw.push(segs);
            }
            rest = &rest[p + root.len()..];
        }
    }
    // Inline relative paths through a child module (`mixtral::Mixtral`).
    let words = outside.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'));
    for word in words {
        let mut segs = word.split("::");
        let Some(first) = segs.next() else { continue };
        if word.contains("::") && is_child(here, first, modules) && !word.starts_with("::") {
            let mut path = vec!["self".to_string(), first.to_string()];
            path.extend(segs.filter(|s| !s.is_empty()).map(str::to_string));
            raw.push(path);
        }
    }
    for segs in raw {
        let mut base: Vec<String> = here.to_vec();
        let mut k = 0;
        if segs[0] == "crate" {
            base.clear();
            k = 1;
        } else if segs[0] == "self" {
            k = 1;
        } else if segs[0] != "super" && !is_child(here, &segs[0], modules) {
            continue;
        }
        while k < segs.len() && segs[k] == "super" {
            base.pop();
            k += 1;
        }
        base.extend(segs[k..].iter().cloned());
        found.push(base);
    }
}

/// Whether `name` is a child module of `here` that has a file of its own.
fn is_child(here: &[String], name: &str, modules: &BTreeMap<Vec<String>, String>) -> bool {
    let mut path = here.to_vec();
    path.push(name.to_string());
    !name.is_empty() && modules.contains_key(&path)
}

/// The next `mod name {` at or after `from`: (its start, the name, the `{`'s index).
fn next_inline_mod(text: &str, from: usize) -> Option<(usize, String, usize)> {
    let mut at = from;
    while let Some(p) = find_word(&text[at..], "mod") {
        let start = at + p;
        let after = text[start + 3..].trim_start();
        let len = after
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        let next = after[len..].trim_start();
        if len > 0 && next.starts_with('{') {
            return Some((start, after[..len].to_string(), text.len() - next.len()));
        }
        at = start + 3;
    }
    None
}

/// The byte offset of `word` in `text` standing as a whole identifier.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let b = text.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut from = 0;
    while let Some(p) = text[from..].find(word) {
        let s = from + p;
        let e = s + word.len();
        if (s == 0 || !ident(b[s - 1])) && (e == b.len() || !ident(b[e])) {
            return Some(s);
        }
        from = s + 1;
    }
    None
}

/// Expands a `use` tree without white space (`a::{b, c::{d}}`, renames marked `@`) into
/// paths.
fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let Some(open) = tree.find('{') else {
        let plain = tree.split('@').next().unwrap_or(tree);
        let mut segs = prefix.clone();
        segs.extend(
            plain
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string),
        );
        out.push(segs);
        return;
    };
    let before = prefix.len();
    prefix.extend(
        tree[..open]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string),
    );
    let body = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut depth = 0usize;
    let mut part = 0;
    for (j, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                if j > part {
                    expand(&body[part..j], prefix, out);
                }
                part = j + 1;
            }
            _ => {}
        }
    }
    if body.len() > part {
        expand(&body[part..], prefix, out);
    }
    prefix.truncate(before);
}
