//! Mutex locking for the whole runtime: a leaf module every part may import (the driver,
//! host memory and each backend) without reaching up to `runtime`'s root.
//!
//! Takes a mutex; gives its guard. Guarantees that a poisoned mutex never turns into a
//! second panic: every critical section of the runtime is a single insert, lookup or
//! counter update, so the data a panicking thread left is consistent.

/// Locks a mutex, recovering the data if a panicking thread poisoned it (module docs:
/// why that is sound here).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
