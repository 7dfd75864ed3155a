//! Where the GGUF fixtures of `scripts/gguf_fixtures.sh` (llama.cpp's own converter,
//! `llama-quantize` and `llama-gguf-split` on moec's synthetic checkpoints) are, in this
//! order:
//! 1. `$MOEC_GGUF_FIXTURES` (tiny Mixtral) and `$MOEC_GGUF_FAMILY_FIXTURES` (Qwen3-MoE,
//!    DeepSeek-V2, DBRX, gpt-oss, ...), when set: that folder only.
//! 2. The repository's recipes (`tests/fixtures/gguf/recipes/`), rebuilt once per target
//!    folder into `$CARGO_TARGET_TMPDIR/gguf-fixtures{,-families}`, so a clean clone runs
//!    the parity tests. The files themselves are too large to commit (the families'
//!    100352-row vocabulary makes each 34-238 MB, most of it the embedding and output): a
//!    recipe is llama.cpp's header with the key/value pairs moec writes alike referenced,
//!    and the tensors are `moec quantize`'s of the same `moec synth` checkpoint, which
//!    writes llama-quantize's bytes. Every rebuilt file must have the sha256 `SHA256SUMS*`
//!    lists for llama.cpp's file, so the tests read llama.cpp's file to the byte; a file
//!    that does not fails the tests that ask, naming it. `MOEC_GGUF_REBUILD=0` skips this
//!    step (the folders take 1.6 GB).
//! 3. `~/.cache/moec-peer/gguf-fixtures{,-families}`, where the script writes.
//!
//! Tests that need the fixtures say why they skip without them.

use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The Mixtral fixture folder, when it holds the Q4_K_M tiny Mixtral.
pub fn fixtures() -> Option<PathBuf> {
    static REBUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    folder(
        "MOEC_GGUF_FIXTURES",
        "gguf-fixtures",
        "mixtral-q4-Q4_K_M.gguf",
        &REBUILT,
    )
}

/// The family fixture folder, when it holds the Q4_K_M tiny DeepSeek-V2.
// Not every test binary that includes this module runs the family fixtures.
#[allow(dead_code)]
pub fn family_fixtures() -> Option<PathBuf> {
    static REBUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    folder(
        "MOEC_GGUF_FAMILY_FIXTURES",
        "gguf-fixtures-families",
        "deepseek-v2-q4-Q4_K_M.gguf",
        &REBUILT,
    )
}

/// `$var` when set; else the folder rebuilt from the recipes in `recipes/{name}`; else
/// `~/.cache/moec-peer/{name}`; each only when it holds `probe`.
fn folder(
    var: &str,
    name: &str,
    probe: &str,
    rebuilt: &OnceLock<Result<PathBuf, String>>,
) -> Option<PathBuf> {
    let holds = |dir: PathBuf| dir.join(probe).is_file().then_some(dir);
    if let Some(dir) = std::env::var_os(var) {
        return holds(PathBuf::from(dir));
    }
    if std::env::var_os("MOEC_GGUF_REBUILD").is_none_or(|v| v != "0") {
        let recipes = repo().join("tests/fixtures/gguf/recipes").join(name);
        if recipes.is_dir() {
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
            // One rebuild per test binary; every test that asks waits for it. A failed
            // rebuild is every asking test's failure: it means moec no longer writes
            // llama.cpp's bytes, or a recipe is stale.
            match rebuilt.get_or_init(|| rebuild_folder(&recipes, &out)) {
                Ok(dir) => return holds(dir.clone()),
                Err(why) => panic!(
                    "rebuilding llama.cpp's GGUF fixtures into {}: {why} (regenerate the \
                     recipes with scripts/gguf_fixtures.sh, or set MOEC_GGUF_REBUILD=0 to \
                     skip them)",
                    out.display()
                ),
            }
        }
    }
    let home = std::env::var_os("HOME")?;
    holds(PathBuf::from(home).join(".cache/moec-peer").join(name))
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Rebuilds every recipe of `recipes` missing from `out`. A file appears under its name
/// only once its sha256 matched, and `.sha256/{name}` says which sum that was, so a present
/// file with today's sum is a checked one (not hashed again); an exclusive lock on
/// `out/.lock` keeps test binaries run in parallel (cargo nextest) from building at once.
fn rebuild_folder(recipes: &Path, out: &Path) -> Result<PathBuf, String> {
    let fail =
        |what: &str, path: &Path, e: std::io::Error| format!("{what} {}: {e}", path.display());
    std::fs::create_dir_all(out).map_err(|e| fail("creating", out, e))?;
    let lock_path = out.join(".lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| fail("creating", &lock_path, e))?;
    lock.lock().map_err(|e| fail("locking", &lock_path, e))?;
    let sums = known_sums()?;
    let mut list: Vec<Recipe> = Vec::new();
    for entry in std::fs::read_dir(recipes).map_err(|e| fail("reading", recipes, e))? {
        let path = entry.map_err(|e| fail("reading", recipes, e))?.path();
        if path.extension().is_some_and(|x| x == "json") {
            list.push(Recipe::read(&path)?);
        }
    }
    // Recipes whose source is another fixture (the split parts) after that fixture.
    list.sort_by_key(|r| (matches!(r.source, Source::Fixture(_)), r.file.clone()));
    let work = out.join(".work");
    let stamps = out.join(".sha256");
    for recipe in &list {
        let want = sums
            .iter()
            .find(|(_, file)| *file == recipe.file)
            .map(|(sum, _)| sum.as_str())
            .ok_or_else(|| format!("{}: in no tests/fixtures/gguf/SHA256SUMS*", recipe.file))?;
        // Built and checked against today's sum: a changed SHA256SUMS rebuilds the file.
        let stamp = stamps.join(&recipe.file);
        let checked = std::fs::read_to_string(&stamp).is_ok_and(|s| s == want);
        if checked && out.join(&recipe.file).is_file() {
            continue;
        }
        std::fs::create_dir_all(&work).map_err(|e| fail("creating", &work, e))?;
        let (source, made) = match &recipe.source {
            Source::Fixture(name) => (out.join(name), None),
            Source::Moec {
                synth,
                mxfp4,
                quantize,
            } => {
                let hf = synthesise(out, synth, *mxfp4)?;
                let made = work.join(format!("moec-{}", recipe.file));
                moec_quantize(&hf, &made, quantize)?;
                (made.clone(), Some(made))
            }
        };
        let part = work.join(format!("{}.part", recipe.file));
        let got = recipe.write(&source, &part)?;
        // moec's file is read; the families' f32 ones are 210 MB.
        if let Some(made) = made {
            std::fs::remove_file(&made).map_err(|e| fail("removing", &made, e))?;
        }
        if got != want {
            return Err(format!(
                "{}: rebuilt with sha256 {got}, llama.cpp's file has {want}",
                recipe.file
            ));
        }
        let dest = out.join(&recipe.file);
        std::fs::rename(&part, &dest).map_err(|e| fail("renaming to", &dest, e))?;
        std::fs::create_dir_all(&stamps).map_err(|e| fail("creating", &stamps, e))?;
        std::fs::write(&stamp, want).map_err(|e| fail("writing", &stamp, e))?;
    }
    // The work folder holds the moec files (and the families' synthetic checkpoints) the
    // tensors came from; only the Mixtral checkpoint stays, as `mixtral-q4-hf`, which the
    // CLI tests quantize and score against.
    if work.is_dir() {
        std::fs::remove_dir_all(&work).map_err(|e| fail("removing", &work, e))?;
    }
    Ok(out.to_path_buf())
}

/// Every `sha256  name` line of `tests/fixtures/gguf/SHA256SUMS*` (llama.cpp's files).
fn known_sums() -> Result<Vec<(String, String)>, String> {
    let dir = repo().join("tests/fixtures/gguf");
    let mut sums = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        let named = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("SHA256SUMS"));
        if !named {
            continue;
        }
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        for line in text.lines() {
            if let Some((sum, file)) = line.split_once("  ") {
                sums.push((sum.to_string(), file.trim().to_string()));
            }
        }
    }
    Ok(sums)
}

/// `moec synth` of `tests/fixtures/gguf/{ron}` (`--mxfp4`: the Hub's MXFP4 experts) into
/// `out`, named as `scripts/gguf_fixtures.sh` names it (`mixtral-q4-hf`), unless there.
fn synthesise(out: &Path, ron: &str, mxfp4: bool) -> Result<PathBuf, String> {
    let stem = ron.trim_end_matches(".ron").trim_end_matches("-tiny");
    let suffix = if mxfp4 { "-hf-mxfp4" } else { "-hf" };
    // The Mixtral checkpoint stays beside the files (the CLI tests quantize and score
    // against it); the others go with the work folder.
    let dir = if stem == "mixtral-q4" && !mxfp4 {
        out.join(format!("{stem}{suffix}"))
    } else {
        out.join(".work").join(format!("{stem}{suffix}"))
    };
    // `moec synth` renames a whole folder into place, so its config means it is complete.
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let model = repo().join("tests/fixtures/gguf").join(ron);
    let mut args = vec!["synth".into(), "--model".into(), model.into_os_string()];
    if mxfp4 {
        args.push("--mxfp4".into());
    }
    args.extend(["--out".into(), dir.clone().into_os_string()]);
    run_moec(&args)?;
    Ok(dir)
}

/// `moec quantize --weights hf --out made FLAGS`, replacing an earlier, interrupted `made`.
fn moec_quantize(hf: &Path, made: &Path, flags: &[String]) -> Result<(), String> {
    if made.exists() {
        std::fs::remove_file(made).map_err(|e| format!("removing {}: {e}", made.display()))?;
    }
    let mut args = vec![
        "quantize".into(),
        "--weights".into(),
        hf.as_os_str().to_owned(),
        "--out".into(),
        made.as_os_str().to_owned(),
    ];
    args.extend(flags.iter().map(Into::into));
    run_moec(&args)
}

fn run_moec(args: &[std::ffi::OsString]) -> Result<(), String> {
    let run = Command::new(env!("CARGO_BIN_EXE_moec"))
        .args(args)
        .output()
        .map_err(|e| format!("running moec: {e}"))?;
    if run.status.success() {
        Ok(())
    } else {
        Err(format!(
            "moec {args:?}: {}",
            String::from_utf8_lossy(&run.stderr).trim()
        ))
    }
}

/// Where a recipe's key/value pairs and tensors come from.
enum Source {
    /// `moec quantize FLAGS` of `moec synth` of the named card (`--mxfp4`).
    Moec {
        synth: String,
        mxfp4: bool,
        quantize: Vec<String>,
    },
    /// Another fixture of the same folder (the parts `llama-gguf-split` cut it into).
    Fixture(String),
}

/// One llama.cpp file as `scripts/gguf_recipe.py` describes it.
struct Recipe {
    /// Its name (as `SHA256SUMS*` lists it).
    file: String,
    /// Its size in bytes (the data's last alignment padding included).
    size: u64,
    source: Source,
    /// llama.cpp's header: its own bytes, or the source's key/value pair of that key.
    header: Vec<Piece>,
}

enum Piece {
    Bytes(Vec<u8>),
    SourcePair(String),
}

impl Recipe {
    fn read(path: &Path) -> Result<Self, String> {
        let bad = |what: &str| format!("{}: {what}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| bad(&e.to_string()))?;
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&e.to_string()))?;
        let string = |v: &serde_json::Value, what: &str| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| bad(&format!("no {what}")))
        };
        let src = &doc["source"];
        let source = if src["file"].is_string() {
            Source::Fixture(string(&src["file"], "source file")?)
        } else {
            let flags = src["quantize"]
                .as_array()
                .ok_or_else(|| bad("no quantize flags"))?;
            Source::Moec {
                synth: string(&src["synth"], "synth card")?,
                mxfp4: src["mxfp4"].as_bool().unwrap_or(false),
                quantize: flags
                    .iter()
                    .map(|f| string(f, "quantize flag"))
                    .collect::<Result<_, _>>()?,
            }
        };
        let pieces = doc["header"].as_array().ok_or_else(|| bad("no header"))?;
        let mut header = Vec::new();
        for piece in pieces {
            header.push(match piece {
                serde_json::Value::String(hex) => {
                    Piece::Bytes(unhex(hex).ok_or_else(|| bad("bad hex"))?)
                }
                other => Piece::SourcePair(string(&other["kv"], "header piece")?),
            });
        }
        Ok(Self {
            file: string(&doc["file"], "file")?,
            size: doc["size"].as_u64().ok_or_else(|| bad("no size"))?,
            source,
            header,
        })
    }

    /// Writes the file to `part` from `source` (as `scripts/gguf_recipe.py`'s `rebuild`
    /// does) and gives its sha256.
    fn write(&self, source: &Path, part: &Path) -> Result<String, String> {
        let src_bytes = std::fs::read(source).map_err(|e| format!("{}: {e}", source.display()))?;
        let src = Header::parse(&src_bytes).map_err(|e| format!("{}: {e}", source.display()))?;
        let mut header = Vec::new();
        for piece in &self.header {
            match piece {
                Piece::Bytes(b) => header.extend_from_slice(b),
                Piece::SourcePair(key) => {
                    let range = src
                        .pairs
                        .iter()
                        .find(|(k, _)| k == key)
                        .map(|(_, r)| r.clone());
                    let range = range.ok_or_else(|| format!("{}: no `{key}`", source.display()))?;
                    header.extend_from_slice(&src_bytes[range]);
                }
            }
        }
        let ours = Header::parse(&header).map_err(|e| format!("{}: {e}", self.file))?;
        let file = std::fs::File::create(part).map_err(|e| format!("{}: {e}", part.display()))?;
        let mut out = HashingWriter {
            inner: std::io::BufWriter::new(file),
            hash: Sha256::new(),
            written: 0,
        };
        let io = |e: std::io::Error| format!("{}: {e}", part.display());
        out.put(&header).map_err(io)?;
        let mut tensors: Vec<&TensorInfo> = ours.tensors.iter().collect();
        tensors.sort_by_key(|t| t.offset);
        for t in tensors {
            let theirs = src
                .tensors
                .iter()
                .find(|s| s.name == t.name)
                .ok_or_else(|| format!("{}: no tensor `{}`", source.display(), t.name))?;
            if (theirs.ggml_type, &theirs.dims) != (t.ggml_type, &t.dims) {
                return Err(format!(
                    "{}: `{}` is type {} {:?} in moec's file, {} {:?} in llama.cpp's",
                    self.file, t.name, theirs.ggml_type, theirs.dims, t.ggml_type, t.dims
                ));
            }
            let bytes = src
                .data_start
                .checked_add(theirs.offset)
                .and_then(|start| usize::try_from(start).ok())
                .zip(theirs.bytes().and_then(|n| usize::try_from(n).ok()))
                .and_then(|(s, n)| src_bytes.get(s..s.checked_add(n)?))
                .ok_or_else(|| format!("{}: `{}` is cut short", source.display(), t.name))?;
            // A tensor must start after the last and end within the file's size, so a
            // corrupt offset is an error rather than a huge write.
            let at = ours.data_start.checked_add(t.offset);
            let fits = at.filter(|&at| {
                at >= out.written && at.checked_add(bytes.len() as u64) <= Some(self.size)
            });
            let at = fits.ok_or_else(|| {
                format!(
                    "{}: `{}` at data offset {} does not fit between the last tensor and \
                     the file's {} bytes",
                    self.file, t.name, t.offset, self.size
                )
            })?;
            out.zeros_to(at).map_err(io)?;
            out.put(bytes).map_err(io)?;
        }
        if out.written > self.size {
            return Err(format!("{}: longer than {} bytes", self.file, self.size));
        }
        out.zeros_to(self.size).map_err(io)?;
        out.inner.flush().map_err(io)?;
        Ok(out
            .hash
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect())
    }
}

/// Writes through to a file and a running sha256, counting bytes.
struct HashingWriter<W: Write> {
    inner: W,
    hash: Sha256,
    written: u64,
}

impl<W: Write> HashingWriter<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.inner.write_all(bytes)?;
        self.hash.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Zeros (alignment padding) up to byte `end` of the file, `end` not before `written`.
    fn zeros_to(&mut self, end: u64) -> std::io::Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        while self.written < end {
            let n = (end - self.written).min(ZEROS.len() as u64) as usize;
            self.put(&ZEROS[..n])?;
        }
        Ok(())
    }
}

fn unhex(hex: &str) -> Option<Vec<u8>> {
    let digits = hex.as_bytes();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    digits
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

/// One tensor's entry in a GGUF header.
struct TensorInfo {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    /// From the start of the data.
    offset: u64,
}

impl TensorInfo {
    /// Its data's length, for the ggml types these fixtures hold.
    fn bytes(&self) -> Option<u64> {
        let (block, size) = match self.ggml_type {
            0 => (1, 4),      // F32
            1 | 30 => (1, 2), // F16, BF16
            2 => (32, 18),    // Q4_0
            3 => (32, 20),    // Q4_1
            8 => (32, 34),    // Q8_0
            12 => (256, 144), // Q4_K
            13 => (256, 176), // Q5_K
            14 => (256, 210), // Q6_K
            39 => (32, 17),   // MXFP4
            _ => return None,
        };
        let count = self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?;
        (count % block == 0).then(|| count / block * size)
    }
}

/// A GGUF (version 3) header: each key/value pair's byte range (key included), the tensor
/// entries, and where the data starts. Only what rebuilding needs; moec's reader is
/// `moec::model::gguf`, which these tests must not lean on to check its own input.
struct Header {
    pairs: Vec<(String, std::ops::Range<usize>)>,
    tensors: Vec<TensorInfo>,
    data_start: u64,
}

impl Header {
    fn parse(bytes: &[u8]) -> Result<Self, String> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != b"GGUF" || r.u32()? != 3 {
            return Err("not a version 3 GGUF file".into());
        }
        let (n_tensors, n_pairs) = (r.u64()?, r.u64()?);
        let mut pairs = Vec::new();
        let mut alignment = 32u64;
        for _ in 0..n_pairs {
            let start = r.at;
            let key = r.string()?;
            let kind = r.u32()?;
            if key == "general.alignment" && kind == 4 {
                alignment = u64::from(Reader { bytes, at: r.at }.u32()?);
            }
            r.skip_value(kind)?;
            pairs.push((key, start..r.at));
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<_, _>>()?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type: r.u32()?,
                offset: r.u64()?,
            });
        }
        if alignment == 0 {
            return Err("general.alignment is 0".into());
        }
        let data_start = (r.at as u64).div_ceil(alignment) * alignment;
        Ok(Self {
            pairs,
            tensors,
            data_start,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], String> {
        let end = usize::try_from(n).ok().and_then(|n| self.at.checked_add(n));
        let got = end.and_then(|end| self.bytes.get(self.at..end));
        let got = got.ok_or_else(|| format!("header cut short at byte {}", self.at))?;
        self.at += got.len();
        Ok(got)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| format!("a name that is not UTF-8 before byte {}", self.at))
    }

    fn skip_value(&mut self, kind: u32) -> Result<(), String> {
        let size = match kind {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                let n = self.u64()?;
                return self.take(n).map(drop);
            }
            9 => {
                let (sub, count) = (self.u32()?, self.u64()?);
                return (0..count).try_for_each(|_| self.skip_value(sub));
            }
            other => return Err(format!("value type {other} at byte {}", self.at)),
        };
        self.take(size).map(drop)
    }
}
