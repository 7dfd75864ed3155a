//! Typed `u32` ids for the IR's tables (cranelift's entity pattern, without the crate).
//!
//! Gives newtypes that index `Program`'s vectors; an id is only meaningful for the program
//! that issued it. Ids serialise as bare integers.

use serde::{Deserialize, Serialize};

macro_rules! define_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            /// The id for position `index` of its table.
            pub fn new(index: usize) -> Self {
                $name(u32::try_from(index).unwrap_or(u32::MAX))
            }

            /// The position in its table.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

define_id!(
    /// A task: its position in issue order.
    TaskId, "t"
);
define_id!(
    /// A buffer (one element of a declared array); `BufferId(0)` is the checkpoint `W`.
    BufferId, "b"
);
define_id!(
    /// A stream.
    StreamId, "s"
);
define_id!(
    /// A declared param.
    ParamId, "p"
);
define_id!(
    /// A step template (prefill, decode or mixed).
    StepId, "step"
);
