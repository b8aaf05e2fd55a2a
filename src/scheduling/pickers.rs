//! Pickers: turn total scores into an ordered list (primary first, then fallbacks).
//!
//! - max-score: by total score, descending; equal scores in random order so equal endpoints
//!   share bursts instead of the first one taking them all;
//! - random: uniform order, scores ignored;
//! - weighted-random: sampled without replacement with probability ∝ score (Efraimidis–
//!   Spirakis keys `u^(1/w)`); zero-score endpoints come last in random order.

use super::spec::PickerSpec;

/// Orders candidate indices `0..scores.len()` by the picker's rule and keeps at most `limit`.
pub fn order(picker: &PickerSpec, scores: &[f64], limit: usize) -> Vec<usize> {
    let mut keyed: Vec<(f64, u64, usize)> = match picker {
        PickerSpec::MaxScore { .. } => scores
            .iter()
            .enumerate()
            .map(|(i, s)| (finite(*s), fastrand::u64(..), i))
            .collect(),
        PickerSpec::Random { .. } => scores
            .iter()
            .enumerate()
            .map(|(i, _)| (0.0, fastrand::u64(..), i))
            .collect(),
        PickerSpec::WeightedRandom { .. } => scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let w = finite(*s);
                let key = if w > 0.0 {
                    // u in (0, 1]; larger keys first. ln keeps precision: ln(u) / w.
                    let u = 1.0 - fastrand::f64();
                    u.ln() / w
                } else {
                    f64::NEG_INFINITY
                };
                (key, fastrand::u64(..), i)
            })
            .collect(),
    };
    let by_key =
        |a: &(f64, u64, usize), b: &(f64, u64, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let limit = limit.min(keyed.len());
    if limit == 1 {
        // The common case (no fallbacks): one linear pass.
        return keyed
            .iter()
            .min_by(|a, b| by_key(a, b))
            .map(|k| vec![k.2])
            .unwrap_or_default();
    }
    keyed.sort_unstable_by(by_key);
    keyed.truncate(limit);
    keyed.into_iter().map(|(_, _, i)| i).collect()
}

fn finite(score: f64) -> f64 {
    if score.is_finite() {
        score.max(0.0)
    } else {
        0.0
    }
}

/// The picker's own bound on endpoints returned (`maxNumOfEndpoints`).
pub fn max_endpoints(picker: &PickerSpec) -> Option<usize> {
    match picker {
        PickerSpec::MaxScore { max_endpoints }
        | PickerSpec::Random { max_endpoints }
        | PickerSpec::WeightedRandom { max_endpoints } => *max_endpoints,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const MAX: PickerSpec = PickerSpec::MaxScore {
        max_endpoints: None,
    };

    #[test]
    fn max_score_orders_and_breaks_ties_randomly() {
        assert_eq!(order(&MAX, &[0.2, 0.9, 0.5], 3), vec![1, 2, 0]);
        assert_eq!(order(&MAX, &[0.2, 0.9, 0.5], 1), vec![1]);
        assert_eq!(order(&MAX, &[0.2, 0.9, 0.5], 2), vec![1, 2]);
        assert_eq!(order(&MAX, &[f64::NAN, 0.1], 1), vec![1], "NaN counts as 0");
        let mut firsts = HashMap::new();
        for _ in 0..300 {
            *firsts
                .entry(order(&MAX, &[0.7, 0.1, 0.7, 0.7], 1)[0])
                .or_insert(0) += 1;
        }
        assert_eq!(firsts.len(), 3, "{firsts:?}");
        assert!(!firsts.contains_key(&1));
        assert!(order(&MAX, &[], 3).is_empty());
    }

    #[test]
    fn weighted_random_follows_scores() {
        let picker = PickerSpec::WeightedRandom {
            max_endpoints: None,
        };
        let mut counts = [0u32; 3];
        for _ in 0..4000 {
            counts[order(&picker, &[0.75, 0.25, 0.0], 1)[0]] += 1;
        }
        assert_eq!(counts[2], 0, "zero score never first while others score");
        let share = f64::from(counts[0]) / 4000.0;
        assert!((0.70..0.80).contains(&share), "{counts:?}");
        let full = order(&picker, &[0.75, 0.25, 0.0], 3);
        assert_eq!(full.len(), 3);
        assert_eq!(full[2], 2, "zero score last");
    }

    #[test]
    fn random_ignores_scores() {
        let picker = PickerSpec::Random {
            max_endpoints: None,
        };
        let mut counts = [0u32; 2];
        for _ in 0..1000 {
            counts[order(&picker, &[1.0, 0.0], 1)[0]] += 1;
        }
        assert!(counts[1] > 350 && counts[0] > 350, "{counts:?}");
        let mut all = order(&picker, &[1.0, 0.0, 0.5], 3);
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2]);
    }
}
