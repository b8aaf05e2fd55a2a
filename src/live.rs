//! A value the request path reads on every request and a watcher replaces whole (the
//! objectives and model rewrites, which Kubernetes objects change while kvpick runs).

use std::sync::{Arc, PoisonError, RwLock};

/// A shared, swappable value: readers take an `Arc` snapshot, a writer replaces it.
///
/// NOTE: a `RwLock` around an `Arc` (no new dependency): a read holds the lock only for one
/// `Arc` clone, and writes happen when an API object changes, so readers never wait in
/// practice. A request keeps the snapshot it took, so one request sees one consistent set.
#[derive(Debug)]
pub struct Live<T>(Arc<RwLock<Arc<T>>>);

impl<T> Clone for Live<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T: Default> Default for Live<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

impl<T> Live<T> {
    /// A live value starting at `value`.
    pub fn new(value: T) -> Self {
        Self(Arc::new(RwLock::new(Arc::new(value))))
    }

    /// The current value.
    pub fn load(&self) -> Arc<T> {
        // A writer cannot panic while holding the lock (it only swaps an Arc), so a poisoned
        // lock still holds a whole value.
        Arc::clone(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Replaces the value; readers see it from their next `load`.
    pub fn store(&self, value: T) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_survives_a_store_and_the_next_load_sees_it() {
        let live = Live::new(1);
        let other = live.clone();
        let before = live.load();
        other.store(2);
        assert_eq!((*before, *live.load()), (1, 2));
    }
}
