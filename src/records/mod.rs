//! Run records: the plain data a run leaves behind (measured steps, loads, task times)
//! and the timeline format both the simulator and the runtime write.
//!
//! Takes nothing; gives [`run`] (what the driver measured), [`load`] (where the time before
//! the first token went) and [`timeline`] (spans on
//! streams, written as a Perfetto trace or an SVG Gantt chart). Both `runtime` (producer)
//! and `cost` (replay, simulator) import this module, never each other.

pub mod load;
pub mod run;
pub mod timeline;

pub use run::{GraphStep, GraphUse, RunStats, StepRecord, StepSplit, TaskRecord, TaskRun, UbLoad};
