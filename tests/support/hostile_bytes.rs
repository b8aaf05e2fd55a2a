//! Hostile variants of a real payload, deterministically: its truncations and byte mutations,
//! for tests of what reads network bytes.

/// Calls `check` with `payload` cut at every `cut_step`-th length, then with `mutations`
/// copies of it with 1–3 bytes set to random values (from `rng`); `check` says whether the
/// variant decoded. Returns how many did and how many were rejected.
pub fn cuts_and_mutations(
    payload: &[u8],
    cut_step: usize,
    mutations: usize,
    rng: &mut fastrand::Rng,
    mut check: impl FnMut(&[u8]) -> bool,
) -> (usize, usize) {
    let (mut decoded, mut rejected) = (0, 0);
    let mut count = |ok: bool| {
        if ok {
            decoded += 1;
        } else {
            rejected += 1;
        }
    };
    for cut in (0..payload.len()).step_by(cut_step.max(1)) {
        count(check(&payload[..cut]));
    }
    for _ in 0..mutations {
        let mut mutated = payload.to_vec();
        for _ in 0..rng.usize(1..4) {
            let at = rng.usize(..mutated.len());
            mutated[at] = rng.u8(..);
        }
        count(check(&mutated));
    }
    (decoded, rejected)
}
