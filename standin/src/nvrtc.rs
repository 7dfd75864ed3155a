//! The NVRTC entry points (`nvrtc*`): "compiling" a CUDA source builds it for the CPU.
//!
//! Takes a program (source and name) and NVRTC options (`--gpu-architecture=`/`-arch=`,
//! `--include-path=`/`-I`; others are accepted and ignored, as they only tune GPU code);
//! gives an image the stand-in driver loads (see [`crate::module`]) in place of PTX, which
//! still carries `.target <arch>` and one `.entry <name>(` line per kernel as PTX would.
//! Guarantees: a source the host compiler rejects returns `NVRTC_ERROR_COMPILATION` with
//! the compiler's log (naming the program's file and line) as the program log.

use crate::module;
use crate::{guard, lock, log, Handles};
use std::ffi::{c_char, c_int, CStr};
use std::sync::{Arc, Mutex};

const SUCCESS: c_int = 0;
const INVALID_INPUT: c_int = 3;
const INVALID_PROGRAM: c_int = 4;
const COMPILATION: c_int = 6;
const INTERNAL_ERROR: c_int = 11;

struct Program {
    source: String,
    name: String,
    log: Mutex<String>,
    image: Mutex<Option<String>>,
}

static PROGRAMS: Handles<Program> = Handles::new(0xa000_0000);

fn program(handle: *mut std::ffi::c_void) -> Result<Arc<Program>, c_int> {
    PROGRAMS.get(handle as usize).ok_or_else(|| {
        log(&format!("NVRTC: unknown program {:#x}", handle as usize));
        INVALID_PROGRAM
    })
}

fn run(call: &str, body: impl FnOnce() -> Result<(), c_int>) -> c_int {
    guard(call, INTERNAL_ERROR, || match body() {
        Ok(()) => SUCCESS,
        Err(e) => e,
    })
}

#[no_mangle]
unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int {
    if major.is_null() || minor.is_null() {
        return INVALID_INPUT;
    }
    // SAFETY: both pointers are non-null and point at caller integers.
    unsafe {
        major.write(12);
        minor.write(8);
    }
    SUCCESS
}

#[no_mangle]
unsafe extern "C" fn nvrtcCreateProgram(
    out: *mut *mut std::ffi::c_void,
    source: *const c_char,
    name: *const c_char,
    n_headers: c_int,
    _headers: *const *const c_char,
    _include_names: *const *const c_char,
) -> c_int {
    run("nvrtcCreateProgram", || {
        if out.is_null() || source.is_null() {
            return Err(INVALID_INPUT);
        }
        if n_headers > 0 {
            log("nvrtcCreateProgram refused: in-memory headers are not supported by the stand-in");
            return Err(INVALID_INPUT);
        }
        // SAFETY: NVRTC's contract: a NUL-terminated source and an optional name.
        let (source, name) = unsafe {
            (
                CStr::from_ptr(source).to_string_lossy().into_owned(),
                if name.is_null() {
                    "default_program".to_string()
                } else {
                    CStr::from_ptr(name).to_string_lossy().into_owned()
                },
            )
        };
        let handle = PROGRAMS.insert(Arc::new(Program {
            source,
            name,
            log: Mutex::new(String::new()),
            image: Mutex::new(None),
        }));
        // SAFETY: `out` is non-null and points at the caller's program slot.
        unsafe { out.write(handle as *mut std::ffi::c_void) };
        Ok(())
    })
}

#[no_mangle]
unsafe extern "C" fn nvrtcCompileProgram(
    handle: *mut std::ffi::c_void,
    n_options: c_int,
    options: *const *const c_char,
) -> c_int {
    run("nvrtcCompileProgram", || {
        let program = program(handle)?;
        let mut arch = "compute_52".to_string();
        let mut includes = Vec::new();
        let n = usize::try_from(n_options).unwrap_or(0);
        let mut list = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: NVRTC's contract: `options` holds n_options C strings.
            let option = unsafe { *options.add(i) };
            if !option.is_null() {
                // SAFETY: non-null option strings are NUL-terminated.
                list.push(
                    unsafe { CStr::from_ptr(option) }
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
        let mut iter = list.iter();
        while let Some(option) = iter.next() {
            if let Some(a) = option
                .strip_prefix("--gpu-architecture=")
                .or_else(|| option.strip_prefix("-arch="))
            {
                arch = a.to_string();
            } else if let Some(dir) = option.strip_prefix("--include-path=") {
                includes.push(dir.to_string());
            } else if option == "-I" || option == "--include-path" {
                includes.extend(iter.next().cloned());
            } else if let Some(dir) = option.strip_prefix("-I") {
                includes.push(dir.to_string());
            }
        }
        match module::compile(&program.source, &program.name, &includes) {
            Ok(object) => {
                let entries = module::entry_names(&program.source);
                *lock(&program.image) =
                    Some(module::image(&object, &program.name, &arch, &entries));
                lock(&program.log).clear();
                Ok(())
            }
            Err(compiler_log) => {
                *lock(&program.log) = compiler_log;
                Err(COMPILATION)
            }
        }
    })
}

fn copy_out(text: &str, out: *mut c_char) -> Result<(), c_int> {
    if out.is_null() {
        return Err(INVALID_INPUT);
    }
    // SAFETY: NVRTC's contract: the caller sized `out` with the matching *Size call
    // (text length + 1).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast::<u8>(), text.len());
        out.add(text.len()).write(0);
    }
    Ok(())
}

fn put_size(out: *mut usize, size: usize) -> Result<(), c_int> {
    if out.is_null() {
        return Err(INVALID_INPUT);
    }
    // SAFETY: non-null, points at the caller's size_t.
    unsafe { out.write(size) };
    Ok(())
}

fn image_of(program: &Arc<Program>) -> Result<String, c_int> {
    lock(&program.image).clone().ok_or_else(|| {
        log("nvrtcGetPTX refused: the program was not compiled successfully");
        INVALID_PROGRAM
    })
}

#[no_mangle]
extern "C" fn nvrtcGetPTXSize(handle: *mut std::ffi::c_void, size: *mut usize) -> c_int {
    run("nvrtcGetPTXSize", || {
        put_size(size, image_of(&program(handle)?)?.len() + 1)
    })
}

#[no_mangle]
extern "C" fn nvrtcGetPTX(handle: *mut std::ffi::c_void, out: *mut c_char) -> c_int {
    run("nvrtcGetPTX", || {
        copy_out(&image_of(&program(handle)?)?, out)
    })
}

#[no_mangle]
extern "C" fn nvrtcGetProgramLogSize(handle: *mut std::ffi::c_void, size: *mut usize) -> c_int {
    run("nvrtcGetProgramLogSize", || {
        put_size(size, lock(&program(handle)?.log).len() + 1)
    })
}

#[no_mangle]
extern "C" fn nvrtcGetProgramLog(handle: *mut std::ffi::c_void, out: *mut c_char) -> c_int {
    run("nvrtcGetProgramLog", || {
        copy_out(&lock(&program(handle)?.log), out)
    })
}

#[no_mangle]
unsafe extern "C" fn nvrtcDestroyProgram(handle: *mut *mut std::ffi::c_void) -> c_int {
    run("nvrtcDestroyProgram", || {
        if handle.is_null() {
            return Err(INVALID_INPUT);
        }
        // SAFETY: non-null, points at the caller's program slot.
        let value = unsafe { *handle };
        PROGRAMS.remove(value as usize).ok_or(INVALID_PROGRAM)?;
        // SAFETY: as above.
        unsafe { handle.write(std::ptr::null_mut()) };
        Ok(())
    })
}

#[no_mangle]
extern "C" fn nvrtcGetErrorString(result: c_int) -> *const c_char {
    match result {
        SUCCESS => c"NVRTC_SUCCESS",
        INVALID_INPUT => c"NVRTC_ERROR_INVALID_INPUT",
        INVALID_PROGRAM => c"NVRTC_ERROR_INVALID_PROGRAM",
        COMPILATION => c"NVRTC_ERROR_COMPILATION",
        _ => c"NVRTC_ERROR_INTERNAL_ERROR",
    }
    .as_ptr()
}
