//! The cost model: hardware profiles, the Hierarchical Roofline Model, analytical bounds.
//!
//! Takes a compiled schedule's per-task work (FLOPs, bytes per level, copies) and a
//! hardware profile; gives task times, throughput bounds, memory budgets, simulated
//! timelines and planned parameters. Knows nothing of the schedule language's syntax.

pub mod activation;
pub mod bounds;
pub mod budget;
pub mod hardware;
pub mod hrm;
pub mod plan;
pub mod predict;
pub mod prefetch;
pub mod probe;
pub mod rates;
pub mod replay;
pub mod reproduce;
pub mod sim;
pub mod step;
pub mod workloads;

pub use hardware::{ComputeDtype, HardwareError, HardwareProfile, Level, Processor};
