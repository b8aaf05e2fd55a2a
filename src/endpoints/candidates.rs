//! The candidates of a pick: the pool's endpoints less those that are down.

use std::sync::Arc;

use super::datastore::EndpointState;

/// The endpoints that are not down; all of them when every one is down.
pub fn live_candidates<'a>(
    endpoints: impl IntoIterator<Item = &'a Arc<EndpointState>>,
) -> Vec<Arc<EndpointState>> {
    let all: Vec<Arc<EndpointState>> = endpoints.into_iter().cloned().collect();
    if all.iter().all(|e| e.liveness.is_down()) {
        return all;
    }
    all.into_iter().filter(|e| !e.liveness.is_down()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::Endpoint;

    #[test]
    fn down_endpoints_are_left_out_unless_none_is_left() {
        let state = |i: u8| {
            Arc::new(EndpointState::new(Endpoint::new(
                format!("10.0.0.{i}:8000").parse().expect("addr"),
            )))
        };
        let pool = vec![state(1), state(2)];
        pool[0].liveness.set(Some("gone".into()));
        let live = live_candidates(&pool);
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].id(), pool[1].id());
        pool[1].liveness.set(Some("gone".into()));
        assert_eq!(live_candidates(&pool).len(), 2, "all down: keep all");
        assert!(live_candidates(&[]).is_empty());
    }
}
