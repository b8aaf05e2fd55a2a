//! Empty: this package holds only end-to-end tests (`tests/`); see its Cargo.toml for why
//! they are not kvpick's own.
