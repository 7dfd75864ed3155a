//! Kernels for the CPU: the stand-in NVRTC's compiler and the driver's module loader.
//!
//! Takes a CUDA C source (one of `kernels/*.cu`, or any source that sticks to the builtins
//! `kernels/cpu_emulation/shim.h` emulates); gives a shared object built by the host C++
//! compiler from the shim, the source, and a launcher per `extern "C" __global__` entry,
//! plus a text "image" (what NVRTC would return as PTX) naming that object and the entries.
//! Each launcher reads its kernel's parameter types from the kernel's own signature (C++
//! template deduction), so the driver learns every parameter's size and whether it is a
//! pointer without parsing C types. Objects are cached by a hash of everything that goes
//! into them, under `MOEC_STANDIN_CACHE` (default: `moec-standin` in the user's cache
//! directory), and written atomically so parallel processes can share the cache.
//!
//! Guarantees: a source the host compiler rejects gives the compiler's log (with the
//! program's own file name and line numbers); an image that is not a stand-in image, a
//! missing object or an entry the image does not name are errors, never crashes.

use crate::log;
use std::ffi::{c_uint, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The emulation of the CUDA builtins, compiled in front of every source.
const SHIM: &str = include_str!("../../kernels/cpu_emulation/shim.h");

/// First line of every image the stand-in NVRTC produces.
pub const IMAGE_MAGIC: &str = "// moec-standin module";

/// Launchers and parameter descriptions for each entry, appended after the kernel source.
const LAUNCHERS: &str = r#"
#include <type_traits>
#include <utility>
template <class... A, std::size_t... I>
static void moec_call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<A*>(p[I])...);
}
template <class... A> constexpr std::size_t moec_arity(void (*)(A...)) { return sizeof...(A); }
template <class... A>
static unsigned moec_describe(void (*)(A...), unsigned* sizes, unsigned char* ptrs, unsigned cap) {
    unsigned i = 0;
    ((i < cap ? (sizes[i] = sizeof(A), ptrs[i] = std::is_pointer_v<A>, 0) : 0, ++i), ...);
    return i;
}
#define MOEC_ENTRY(name)                                                                    \
    extern "C" __attribute__((visibility("default"))) unsigned moec_params_##name(         \
        unsigned* sizes, unsigned char* ptrs, unsigned cap) {                               \
        return moec_describe(name, sizes, ptrs, cap);                                       \
    }                                                                                       \
    extern "C" __attribute__((visibility("default"))) void moec_launch_##name(             \
        const unsigned* d, void** p) {                                                      \
        launch_grid({d[0], d[1], d[2]}, {d[3], d[4], d[5]},                                 \
                    [p] { moec_call(name, p, std::make_index_sequence<moec_arity(name)>{}); }); \
    }
"#;

/// The names of the `extern "C" __global__` functions `source` defines, in order.
pub fn entry_names(source: &str) -> Vec<String> {
    const MARKER: &str = "extern \"C\" __global__";
    source
        .match_indices(MARKER)
        .filter_map(|(at, _)| {
            let rest = &source[at + MARKER.len()..];
            let before_paren = &rest[..rest.find('(')?];
            before_paren.split_whitespace().last().map(str::to_string)
        })
        .collect()
}

/// Rewrites `extern __shared__ T name[];` (dynamic shared memory, which has no host
/// equivalent) into a pointer to the shim's dynamic shared memory array.
fn rewrite_dynamic_shared(source: &str) -> String {
    const MARKER: &str = "extern __shared__";
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find(MARKER) {
        out.push_str(&rest[..at]);
        let after = &rest[at + MARKER.len()..];
        let Some(end) = after.find(';') else {
            out.push_str(&rest[at..]);
            return out;
        };
        let declaration = after[..end].trim();
        // "float q_group[]" -> type "float", name "q_group".
        let without_brackets = declaration.trim_end_matches("[]").trim_end();
        match without_brackets.rsplit_once(char::is_whitespace) {
            Some((ty, name)) if declaration.ends_with("[]") => {
                out.push_str(&format!("{ty}* {name} = reinterpret_cast<{ty}*>(dyn_smem)"));
            }
            _ => out.push_str(&rest[at..at + MARKER.len() + end]),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The C++ translation unit for `source` named `name`.
pub fn translation_unit(source: &str, name: &str) -> String {
    let mut unit = String::new();
    unit.push_str(SHIM);
    unit.push_str(&format!("\n#line 1 \"{}\"\n", name.replace('"', "")));
    unit.push_str(&rewrite_dynamic_shared(source));
    unit.push_str("\n#line 1 \"moec-standin-launchers\"\n");
    unit.push_str(LAUNCHERS);
    for entry in entry_names(source) {
        unit.push_str(&format!("MOEC_ENTRY({entry})\n"));
    }
    unit
}

/// 64-bit FNV-1a: a stable hash for cache keys (std's hasher may change between releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &byte in *part {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        hash ^= 0xff;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MOEC_STANDIN_CACHE") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("moec-standin")
}

const CXX_FLAGS: [&str; 7] = [
    "-std=c++20",
    "-O2",
    "-shared",
    "-fPIC",
    "-pthread",
    "-fvisibility=hidden",
    // The kernels spell out their fused multiply-adds (fmaf); keep the rest unfused so
    // results do not depend on the compiler's contraction choices.
    "-ffp-contract=off",
];

/// Builds (or finds in the cache) the shared object for `source`; `include_dirs` come from
/// NVRTC's `--include-path` options. Returns the object's path, or the compiler's log.
pub fn compile(source: &str, name: &str, include_dirs: &[String]) -> Result<PathBuf, String> {
    let unit = translation_unit(source, name);
    let compiler = std::env::var("MOEC_STANDIN_CXX").unwrap_or_else(|_| "g++".to_string());
    let key = fnv1a(&[
        unit.as_bytes(),
        compiler.as_bytes(),
        CXX_FLAGS.join(" ").as_bytes(),
        include_dirs.join("\n").as_bytes(),
    ]);
    let dir = cache_dir();
    let object = dir.join(format!("{key:016x}.so"));
    if object.is_file() {
        return Ok(object);
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| format!("cannot create the kernel cache {}: {e}", dir.display()))?;
    // One compile per object across processes: the CUDA tests start stand-in runs two at a
    // time on a cold cache (CI's), and each used to run g++ on every kernel file itself. A
    // process that finds the lock held waits, then takes the object the holder built; a
    // lock that cannot be taken only costs a compile of its own.
    let lock = std::fs::File::create(dir.join(format!("{key:016x}.lock")))
        .ok()
        .filter(|file| file.lock().is_ok());
    if lock.is_some() && object.is_file() {
        return Ok(object);
    }
    // Unique temporary names: other processes may build the same object at the same time.
    let unique = format!(
        "{key:016x}.{}.{:?}",
        std::process::id(),
        std::thread::current().id()
    )
    .replace(['(', ')'], "");
    let source_path = dir.join(format!("{unique}.cpp"));
    let temp_object = dir.join(format!("{unique}.so.tmp"));
    std::fs::write(&source_path, &unit)
        .map_err(|e| format!("cannot write {}: {e}", source_path.display()))?;
    let mut command = Command::new(&compiler);
    command.args(CXX_FLAGS);
    for include in include_dirs {
        command.arg(format!("-I{include}"));
    }
    command.arg(&source_path).arg("-o").arg(&temp_object);
    let output = command.output();
    let _ = std::fs::remove_file(&source_path);
    let output = output.map_err(|e| {
        format!("cannot run the host compiler `{compiler}` (set MOEC_STANDIN_CXX): {e}")
    })?;
    if !output.status.success() {
        let _ = std::fs::remove_file(&temp_object);
        let log = String::from_utf8_lossy(&output.stderr);
        let path = source_path.display().to_string();
        return Err(log.replace(&path, name));
    }
    std::fs::rename(&temp_object, &object)
        .map_err(|e| format!("cannot move the kernel object into {}: {e}", dir.display()))?;
    Ok(object)
}

/// The image (stand-in "PTX") for an object built from `name` with `entries`, for `arch`.
pub fn image(object: &Path, name: &str, arch: &str, entries: &[String]) -> String {
    let mut text = format!(
        "{IMAGE_MAGIC} (not PTX): {name} compiled for the CPU by the stand-in NVRTC\n\
         .version 8.0\n.target {arch}\n.object {}\n",
        object.display()
    );
    for entry in entries {
        text.push_str(&format!(".entry {entry}(\n"));
    }
    text
}

/// One kernel of a loaded module.
pub struct Kernel {
    /// Entry name.
    pub name: String,
    /// Each parameter's size in bytes.
    pub sizes: Vec<usize>,
    /// Whether each parameter is a pointer (checked against live allocations at launch).
    pub pointers: Vec<bool>,
    launch: unsafe extern "C" fn(*const c_uint, *mut *mut c_void),
    /// Keeps the object loaded while a launch of this kernel may still be queued.
    _library: std::sync::Arc<libloading::Library>,
}

impl Kernel {
    /// Runs the whole grid on the calling thread; `params` points at one pointer per
    /// parameter, each to that parameter's bytes.
    ///
    /// # Safety
    /// `params` must hold `self.sizes.len()` pointers to live buffers of the listed sizes,
    /// and every pointer parameter must address memory the kernel may touch.
    pub unsafe fn run(&self, dims: &[c_uint; 6], params: *mut *mut c_void) {
        // SAFETY: forwarded from the caller's contract; `dims` is six live integers.
        unsafe { (self.launch)(dims.as_ptr(), params) }
    }
}

/// A loaded module: its object and the entries its image names.
pub struct Module {
    library: std::sync::Arc<libloading::Library>,
    entries: Vec<String>,
    /// Where the object came from, for messages.
    pub object: PathBuf,
}

impl Module {
    /// Loads an image produced by the stand-in NVRTC. Errors name what is wrong.
    pub fn load(image: &str) -> Result<Module, String> {
        if !image.starts_with(IMAGE_MAGIC) {
            return Err(
                "the image is not a moec-standin module (real PTX or cubin cannot run on the \
                 stand-in; compile the source through the stand-in NVRTC)"
                    .to_string(),
            );
        }
        let mut object = None;
        let mut entries = Vec::new();
        for line in image.lines() {
            if let Some(path) = line.strip_prefix(".object ") {
                object = Some(PathBuf::from(path.trim()));
            } else if let Some(entry) = line.strip_prefix(".entry ") {
                entries.push(entry.trim_end_matches('(').trim().to_string());
            }
        }
        let object = object.ok_or("the image names no .object")?;
        // SAFETY: the object was built by `compile` from the shim and a kernel source; its
        // initialisers only construct the shim's globals (no I/O, no threads).
        let library = unsafe { libloading::Library::new(&object) }
            .map_err(|e| format!("cannot load {}: {e}", object.display()))?;
        Ok(Module {
            library: std::sync::Arc::new(library),
            entries,
            object,
        })
    }

    /// The kernel `name`, with its parameter layout. Errors if the image does not name it.
    pub fn function(&self, name: &str) -> Result<Kernel, String> {
        if !self.entries.iter().any(|e| e == name) {
            return Err(format!(
                "no kernel named `{name}` in this module (it has: {})",
                self.entries.join(", ")
            ));
        }
        type Describe = unsafe extern "C" fn(*mut c_uint, *mut u8, c_uint) -> c_uint;
        type Launch = unsafe extern "C" fn(*const c_uint, *mut *mut c_void);
        // SAFETY: the symbols were generated by MOEC_ENTRY with exactly these signatures.
        let (describe, launch) = unsafe {
            let describe = self
                .library
                .get::<Describe>(format!("moec_params_{name}").as_bytes())
                .map_err(|e| format!("kernel `{name}`: {e}"))?;
            let launch = self
                .library
                .get::<Launch>(format!("moec_launch_{name}").as_bytes())
                .map_err(|e| format!("kernel `{name}`: {e}"))?;
            (*describe, *launch)
        };
        const CAP: usize = 256;
        let mut sizes = [0 as c_uint; CAP];
        let mut pointers = [0u8; CAP];
        // SAFETY: both buffers hold CAP entries and the describer writes at most CAP.
        let count =
            unsafe { describe(sizes.as_mut_ptr(), pointers.as_mut_ptr(), CAP as c_uint) } as usize;
        if count > CAP {
            return Err(format!("kernel `{name}` has more than {CAP} parameters"));
        }
        log_once_per_kernel(name, count);
        Ok(Kernel {
            name: name.to_string(),
            sizes: sizes[..count].iter().map(|&s| s as usize).collect(),
            pointers: pointers[..count].iter().map(|&p| p != 0).collect(),
            launch,
            _library: std::sync::Arc::clone(&self.library),
        })
    }
}

/// Logs parameter counts only when `MOEC_STANDIN_VERBOSE` is set (quiet by default).
fn log_once_per_kernel(name: &str, count: usize) {
    if std::env::var_os("MOEC_STANDIN_VERBOSE").is_some() {
        log(&format!("loaded kernel {name} ({count} parameters)"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_shared_memory_becomes_a_pointer_into_the_shim() {
        let src = "void k() {\n    extern __shared__ float q_group[];\n    q_group[0] = 1;\n}";
        assert_eq!(
            rewrite_dynamic_shared(src),
            "void k() {\n    float* q_group = reinterpret_cast<float*>(dyn_smem);\n    q_group[0] = 1;\n}"
        );
    }

    #[test]
    fn entries_are_read_from_multi_line_signatures() {
        let src = "extern \"C\" __global__ void a(\n int n) {}\n__device__ void h() {}\nextern \"C\" __global__ void b(float* x) {}";
        assert_eq!(entry_names(src), ["a", "b"]);
    }
}
