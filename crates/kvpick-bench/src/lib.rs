//! `kvpick-bench`: load generation and statistics for whole-system measurements.

pub mod backend;
pub mod load;
pub mod stats;
pub mod workload;
