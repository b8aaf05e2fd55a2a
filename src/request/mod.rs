//! (filled in by the EPP core)
