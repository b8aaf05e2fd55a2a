use super::*;

fn holders(s: &Speculative, key: BlockKey, now: Instant) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    s.visit(&key, now, |h| out.push((h.slot, h.run_back)));
    out
}

#[test]
fn the_filter_says_none_only_when_there_is_none() {
    let speculative = Speculative::new(Duration::from_secs(2), 100);
    let now = Instant::now();
    // Two keys in one filter bucket (same middle bits), one in another.
    let (a, b, c) = (
        BlockKey(1 << 24),
        BlockKey((1 << 24) | 5),
        BlockKey(2 << 24),
    );
    assert!(!speculative.may_hold(&a));
    speculative.record(3, &[a, b], now);
    speculative.record(4, &[a], now);
    assert!(speculative.may_hold(&a) && speculative.may_hold(&b));
    assert!(!speculative.may_hold(&c));
    let mut slots = Vec::new();
    assert!(speculative.visit(&a, now, |h| slots.push(h.slot)));
    assert_eq!(slots, vec![3, 4]);
    assert!(!speculative.visit(&c, now, |_| {}));
    // Confirming and purging take the counts back down to zero.
    speculative.confirm(&a, 3);
    speculative.confirm(&b, 3);
    assert!(speculative.may_hold(&a), "slot 4 still speculates on a");
    speculative.remove_slot(4);
    assert!(!speculative.may_hold(&a) && !speculative.may_hold(&b));
    assert_eq!(speculative.len(), 0);
    // Expired entries leave the filter when purged.
    speculative.record(5, &[c], now);
    speculative.purge_expired(now + Duration::from_secs(3));
    assert!(!speculative.may_hold(&c));
}

#[test]
fn runs_say_how_far_back_a_holder_holds_in_a_row() {
    let speculative = Speculative::new(Duration::from_secs(2), 100);
    let now = Instant::now();
    let keys: Vec<BlockKey> = (1..=6u64).map(|i| BlockKey(i << 24 | i)).collect();
    assert_eq!(speculative.record(7, &keys, now), 0);
    assert_eq!(holders(&speculative, keys[5], now), vec![(7, 6)]);
    // A block of the run confirmed: the entries after it no longer prove the ones before.
    speculative.confirm(&keys[2], 7);
    assert_eq!(holders(&speculative, keys[1], now), vec![(7, 2)]);
    assert_eq!(holders(&speculative, keys[5], now), vec![(7, 1)]);
    // A newer record takes the entries it covers into its own run.
    speculative.record(7, &keys[3..], now);
    assert_eq!(holders(&speculative, keys[5], now), vec![(7, 3)]);
    // Expired runs hold nothing; purged, their ids are reused and start afresh.
    let later = now + Duration::from_secs(3);
    assert!(holders(&speculative, keys[5], later).is_empty());
    speculative.purge_expired(later);
    assert_eq!(speculative.len(), 0);
    speculative.record(8, &keys[..2], later);
    assert_eq!(holders(&speculative, keys[1], later), vec![(8, 2)]);
}

fn keys(from: u64, n: u64) -> Vec<BlockKey> {
    (from..from + n).map(|i| BlockKey(i << 24 | i)).collect()
}

fn written(s: &Speculative) -> usize {
    s.written.swap(0, Ordering::Relaxed)
}

/// Blocks of `keys` held from the first, in a row, at `now`.
fn held_run(s: &Speculative, slot: u32, keys: &[BlockKey], now: Instant) -> usize {
    keys.iter()
        .take_while(|k| holders(s, **k, now).iter().any(|(h, _)| *h == slot))
        .count()
}

#[tokio::test(start_paused = true)]
async fn a_warm_rerecord_writes_only_its_new_tail_and_keeps_the_shared_blocks_alive() {
    let ttl = Duration::from_secs(2);
    let s = Speculative::new(ttl, 1 << 20);
    // 6,250 blocks (a 400 KB prompt), 95% shared with the next request's.
    let bundle = keys(1, 5_937);
    let first = [bundle.clone(), keys(100_000, 313)].concat();
    let second = [bundle.clone(), keys(200_000, 313)].concat();
    let start = Instant::now();
    s.record(1, &first, start);
    assert_eq!(written(&s), 6_250);
    tokio::time::advance(Duration::from_millis(1500)).await;
    s.record(1, &second, Instant::now());
    assert_eq!(written(&s), 313, "only the new tail is written");
    assert_eq!(s.len(), 6_250 + 313);
    // Past the first record's TTL: the shared blocks and the new tail live on (refreshed),
    // the first request's own tail expired with its record, as if its entries had moved.
    tokio::time::advance(Duration::from_millis(600)).await;
    let now = Instant::now();
    assert_eq!(held_run(&s, 1, &second, now), 6_250);
    assert_eq!(held_run(&s, 1, &first, now), 5_937);
    // A walk still proves the shared stretch with one probe at its end.
    assert_eq!(holders(&s, bundle[5_936], now), vec![(1, 5_937)]);
    s.purge_expired(now);
    assert_eq!(s.len(), 6_250);
    // Again, and a growing conversation: the third prompt continues the second.
    let third = [second.clone(), keys(300_000, 100)].concat();
    s.record(1, &third, now);
    assert_eq!(written(&s), 100);
    tokio::time::advance(Duration::from_millis(1900)).await;
    assert_eq!(held_run(&s, 1, &third, Instant::now()), 6_350);
    tokio::time::advance(Duration::from_millis(200)).await;
    assert_eq!(held_run(&s, 1, &third, Instant::now()), 0, "all expired");
}

#[tokio::test(start_paused = true)]
async fn expired_or_broken_runs_are_recorded_whole() {
    let ttl = Duration::from_secs(2);
    let s = Speculative::new(ttl, 1 << 20);
    let prompt = keys(1, 100);
    s.record(1, &prompt, Instant::now());
    assert_eq!(written(&s), 100);
    // Expired: recorded whole again (the entries move into the new run).
    tokio::time::advance(Duration::from_millis(2100)).await;
    s.record(1, &prompt, Instant::now());
    assert_eq!(written(&s), 100);
    assert_eq!(s.len(), 100);
    assert_eq!(held_run(&s, 1, &prompt, Instant::now()), 100);
    // A run whose first entry was confirmed is no longer intact: recorded whole.
    s.confirm(&prompt[0], 1);
    s.record(1, &prompt[1..], Instant::now());
    assert_eq!(written(&s), 99);
    // Another pod's run is not this pod's.
    s.record(2, &prompt, Instant::now());
    assert_eq!(written(&s), 100);
    // A shorter refresh than the run's head, expiring later, cannot be said by the head:
    // those entries move (whole), the rest keeps its expiry.
    s.record(2, &prompt, Instant::now());
    assert_eq!(written(&s), 0, "a whole refresh in place");
    tokio::time::advance(Duration::from_millis(1000)).await;
    s.record(2, &prompt[..40], Instant::now());
    assert_eq!(written(&s), 40);
    tokio::time::advance(Duration::from_millis(1500)).await;
    assert_eq!(held_run(&s, 2, &prompt, Instant::now()), 40);
}

#[test]
fn the_bound_stops_a_run() {
    let speculative = Speculative::new(Duration::from_secs(2), 3);
    let now = Instant::now();
    let keys: Vec<BlockKey> = (1..=5u64).map(|i| BlockKey(i << 24)).collect();
    assert_eq!(speculative.record(1, &keys, now), 2);
    assert_eq!(speculative.len(), 3);
    assert_eq!(holders(&speculative, keys[2], now), vec![(1, 3)]);
    assert!(holders(&speculative, keys[3], now).is_empty());
    // At the bound, a record still refreshes what it finds; behind a refused block its
    // entries prove only themselves.
    speculative.confirm(&keys[0], 1);
    assert_eq!(speculative.record(1, &keys, now), 2);
    assert_eq!(holders(&speculative, keys[0], now), vec![(1, 1)]);
    assert_eq!(holders(&speculative, keys[2], now), vec![(1, 3)]);
    let new = BlockKey(9 << 24);
    assert_eq!(speculative.record(1, &[new, keys[1], keys[2]], now), 1);
    assert!(holders(&speculative, new, now).is_empty());
    assert_eq!(holders(&speculative, keys[2], now), vec![(1, 1)]);
}

/// What every key of `keys` shows a walk: each holder's (slot, run_back, run_ahead).
fn view(s: &Speculative, keys: &[BlockKey], now: Instant) -> Vec<Vec<(u32, u32, u32)>> {
    keys.iter()
        .map(|key| {
            let mut out = Vec::new();
            s.visit(key, now, |h| out.push((h.slot, h.run_back, h.run_ahead)));
            out.sort_unstable();
            out
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_long_record_written_shard_by_shard_ends_as_block_by_block() {
    let ttl = Duration::from_secs(2);
    let by_shard = Speculative::new(ttl, 1 << 20);
    let by_block = Speculative {
        run_from: usize::MAX,
        ..Speculative::new(ttl, 1 << 20)
    };
    // Keys spread over every shard (top bits) and filter bucket (middle bits).
    let key = |i: u64| BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let span = |from: u64, n: u64| (from..from + n).map(key).collect::<Vec<_>>();
    let shared = span(0, 150);
    let mut all = shared.clone();
    // Each step: (slot, keys). A new prompt; one that repeats part of it on the same pod
    // (entries move from the older run, not at its head); another pod's copy; a prompt with a
    // key twice; one after a confirm broke a run; one after the first run expired.
    let repeat_twice = [span(1_000, 40), vec![key(1_010)], span(1_040, 60)].concat();
    let steps: Vec<(u32, Vec<BlockKey>, u64)> = vec![
        (1, shared.clone(), 0),
        (1, [shared[30..].to_vec(), span(500, 80)].concat(), 100),
        (2, [shared.clone(), span(600, 10)].concat(), 100),
        (3, repeat_twice.clone(), 100),
        (1, [shared[..20].to_vec(), span(700, 70)].concat(), 2_500),
        (2, span(600, 90), 100),
    ];
    all.extend(span(500, 80));
    all.extend(span(600, 90));
    all.extend(span(700, 70));
    all.extend(span(1_000, 100));
    for (step, (slot, keys, advance_ms)) in steps.iter().enumerate() {
        tokio::time::advance(Duration::from_millis(*advance_ms)).await;
        if step == 3 {
            for s in [&by_shard, &by_block] {
                s.confirm(&shared[70], 2);
            }
        }
        let now = Instant::now();
        assert_eq!(by_shard.record(*slot, keys, now), 0);
        assert_eq!(by_block.record(*slot, keys, now), 0);
        assert_eq!(
            view(&by_shard, &all, now),
            view(&by_block, &all, now),
            "step {step}"
        );
        assert_eq!(by_shard.len(), by_block.len(), "step {step}");
        for key in &all {
            assert_eq!(by_shard.may_hold(key), by_block.may_hold(key));
        }
    }
    // No step refreshed a run in place (none starts at a live run's first entry), so each
    // wrote ≥ 64 blocks: all six took the shard path.
    assert_eq!(by_shard.shard_records.load(Ordering::Relaxed), 6);
    assert_eq!(by_block.shard_records.load(Ordering::Relaxed), 0);
    // Both purge to nothing.
    tokio::time::advance(Duration::from_secs(3)).await;
    let now = Instant::now();
    by_shard.purge_expired(now);
    by_block.purge_expired(now);
    assert_eq!(by_shard.len(), 0);
    assert_eq!(by_block.len(), 0);
    for key in &all {
        assert!(!by_shard.may_hold(key), "the filter empties with the map");
    }
}

#[tokio::test(start_paused = true)]
async fn confirming_a_run_of_keys_at_once_ends_as_one_by_one() {
    let ttl = Duration::from_secs(2);
    let (at_once, one_by_one) = (
        Speculative::new(ttl, 1 << 20),
        Speculative::new(ttl, 1 << 20),
    );
    let key = |i: u64| BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let span = |from: u64, n: u64| (from..from + n).map(key).collect::<Vec<_>>();
    let (shared, other) = (span(0, 200), span(1_000, 120));
    let all = [shared.clone(), other.clone(), span(5_000, 50)].concat();
    let now = Instant::now();
    for s in [&at_once, &one_by_one] {
        // Two pods on the shared prompt, one of them also on another; a key twice in a run.
        assert_eq!(s.record(1, &shared, now), 0);
        assert_eq!(s.record(2, &shared[..150], now), 0);
        assert_eq!(
            s.record(1, &[other.clone(), vec![shared[5]]].concat(), now),
            0
        );
    }
    // Confirmed: a stretch in the middle of pod 1's run (keys with and without entries, one
    // listed twice, keys nobody speculates on), then the head of pod 2's, then one key.
    let confirms: Vec<(u32, Vec<BlockKey>)> = vec![
        (
            1,
            [shared[40..120].to_vec(), vec![shared[50]], span(5_000, 50)].concat(),
        ),
        (2, shared[..100].to_vec()),
        (1, vec![other[7]]),
        (3, shared.clone()),
    ];
    for (step, (slot, keys)) in confirms.iter().enumerate() {
        at_once.confirm_keys(keys, *slot);
        for key in keys {
            one_by_one.confirm(key, *slot);
        }
        assert_eq!(
            view(&at_once, &all, now),
            view(&one_by_one, &all, now),
            "step {step}"
        );
        assert_eq!(at_once.len(), one_by_one.len(), "step {step}");
        for key in &all {
            assert_eq!(at_once.may_hold(key), one_by_one.may_hold(key));
        }
    }
    // Something was confirmed, and something is left: the comparison saw both.
    assert!(at_once.len() < 200 + 150 + 121 && !at_once.is_empty());
    assert!(
        view(&at_once, &shared[40..120], now)
            .iter()
            .all(|h| h.iter().all(|h| h.0 != 1))
    );
    // Both purge to nothing.
    tokio::time::advance(Duration::from_secs(3)).await;
    for s in [&at_once, &one_by_one] {
        s.purge_expired(Instant::now());
        assert_eq!(s.len(), 0);
    }
}

#[test]
fn a_long_record_near_the_bound_goes_block_by_block_and_stops_at_it() {
    let speculative = Speculative::new(Duration::from_secs(2), 100);
    let now = Instant::now();
    let keys: Vec<BlockKey> = (1..=130u64)
        .map(|i| BlockKey(i << 40 | i << 24 | i))
        .collect();
    // 130 > 100: no reservation, so block by block, refusing from the 101st.
    assert_eq!(speculative.record(1, &keys, now), 30);
    assert_eq!(speculative.len(), 100);
    assert_eq!(holders(&speculative, keys[99], now), vec![(1, 100)]);
    assert!(holders(&speculative, keys[100], now).is_empty());
    assert!(!speculative.may_hold(&keys[129]));
}
