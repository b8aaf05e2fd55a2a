//! Steps over one msgpack value without keeping it: what the reader does with everything the
//! decoder never looks at (unknown keys and their fields, events after one that fails, batch
//! items past `dp_rank`, collections where a field takes a scalar).
//!
//! Why not let rmpv read and drop them: rmpv keeps every element as a 32-byte `Value` (a map
//! pair as 64), so a payload of one-byte elements grows ~30× while it is read. A hostile pod's
//! 16 MiB message of them cost ~640 MB before the batch was rejected.
//!
//! Exactness: a skipped value must fail where and as rmpv's reader fails on it, since the
//! decoded result (errors included) must be what the reference decoder gives. So this walks
//! the bytes as `rmpv::decode::read_value_inner` does: one unit of depth per value, one more
//! per array, map, string (and one more for its bytes), binary and ext (and one more for its
//! bytes), each spent before the bytes it guards are read; and its errors carry rmpv's
//! messages.

use std::io;

use rmpv::decode::Error;

/// Steps over one value from the front of `rest` with `depth` of rmpv's depth budget left,
/// returning how many values it held (itself, its elements, a map's keys and fields).
pub(crate) fn skip(rest: &mut &[u8], depth: usize) -> Result<usize, Error> {
    let depth = spend(depth)?;
    let Some((&marker, tail)) = rest.split_first() else {
        return Err(Error::InvalidMarkerRead(eof()));
    };
    *rest = tail;
    match marker {
        // nil, booleans, fixints, and the reserved 0xc1 (which rmpv reads as nil)
        0x00..=0x7f | 0xe0..=0xff | 0xc0..=0xc3 => Ok(1),
        0xcc | 0xd0 => data(rest, 1).map(|_| 1),
        0xcd | 0xd1 => data(rest, 2).map(|_| 1),
        0xca | 0xce | 0xd2 => data(rest, 4).map(|_| 1),
        0xcb | 0xcf | 0xd3 => data(rest, 8).map(|_| 1),
        0xa0..=0xbf => string(rest, usize::from(marker & 0x1f), depth),
        0xd9 => {
            let len = length(rest, 1)?;
            string(rest, len, depth)
        }
        0xda => {
            let len = length(rest, 2)?;
            string(rest, len, depth)
        }
        0xdb => {
            let len = length(rest, 4)?;
            string(rest, len, depth)
        }
        0xc4 => {
            let len = length(rest, 1)?;
            bytes(rest, len, depth)
        }
        0xc5 => {
            let len = length(rest, 2)?;
            bytes(rest, len, depth)
        }
        0xc6 => {
            let len = length(rest, 4)?;
            bytes(rest, len, depth)
        }
        0x90..=0x9f => array(rest, usize::from(marker & 0x0f), depth),
        0xdc => {
            let len = length(rest, 2)?;
            array(rest, len, depth)
        }
        0xdd => {
            let len = length(rest, 4)?;
            array(rest, len, depth)
        }
        0x80..=0x8f => map(rest, usize::from(marker & 0x0f), depth),
        0xde => {
            let len = length(rest, 2)?;
            map(rest, len, depth)
        }
        0xdf => {
            let len = length(rest, 4)?;
            map(rest, len, depth)
        }
        0xd4 => ext(rest, 1, depth),
        0xd5 => ext(rest, 2, depth),
        0xd6 => ext(rest, 4, depth),
        0xd7 => ext(rest, 8, depth),
        0xd8 => ext(rest, 16, depth),
        0xc7 => {
            let len = length(rest, 1)?;
            ext(rest, len, depth)
        }
        0xc8 => {
            let len = length(rest, 2)?;
            ext(rest, len, depth)
        }
        0xc9 => {
            let len = length(rest, 4)?;
            ext(rest, len, depth)
        }
    }
}

/// rmpv's `decrement_depth`.
fn spend(depth: usize) -> Result<usize, Error> {
    depth.checked_sub(1).ok_or(Error::DepthLimitExceeded)
}

/// The error `read_exact` on a slice gives when it runs out (rmpv reads markers, lengths and
/// numbers with it).
fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "failed to fill whole buffer")
}

/// `n` bytes of a number or length, consumed.
fn data<'a>(rest: &mut &'a [u8], n: usize) -> Result<&'a [u8], Error> {
    let Some((bytes, tail)) = rest.split_at_checked(n) else {
        *rest = &[];
        return Err(Error::InvalidDataRead(eof()));
    };
    *rest = tail;
    Ok(bytes)
}

/// A big-endian length of `n` bytes (1, 2 or 4).
fn length(rest: &mut &[u8], n: usize) -> Result<usize, Error> {
    let bytes = data(rest, n)?;
    let len = bytes.iter().fold(0u64, |len, &b| (len << 8) | u64::from(b));
    // NOTE: a u32 length fits a usize on every target kvpick builds for; saturating keeps it
    // an error (the input is shorter) on any other.
    Ok(usize::try_from(len).unwrap_or(usize::MAX))
}

/// rmpv's `read_str_data`: a unit for the string, then its bytes as binary.
fn string(rest: &mut &[u8], len: usize, depth: usize) -> Result<usize, Error> {
    bytes(rest, len, spend(depth)?)
}

/// rmpv's `read_bin_data`: a unit, then exactly `len` bytes.
fn bytes(rest: &mut &[u8], len: usize, depth: usize) -> Result<usize, Error> {
    spend(depth)?;
    let Some(tail) = rest.get(len..) else {
        let read = rest.len();
        *rest = &[];
        return Err(Error::InvalidDataRead(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("Expected {len} bytes, read {read} bytes"),
        )));
    };
    *rest = tail;
    Ok(1)
}

/// rmpv's `read_ext_body`: a unit, the type byte, then the bytes as binary.
fn ext(rest: &mut &[u8], len: usize, depth: usize) -> Result<usize, Error> {
    let depth = spend(depth)?;
    data(rest, 1)?;
    bytes(rest, len, depth)
}

/// rmpv's `read_array_data`: a unit (even when empty), then each element.
fn array(rest: &mut &[u8], len: usize, depth: usize) -> Result<usize, Error> {
    let depth = spend(depth)?;
    let mut values = 1;
    for _ in 0..len {
        values += skip(rest, depth)?;
    }
    Ok(values)
}

/// rmpv's `read_map_data`: a unit (even when empty), then each key and field.
fn map(rest: &mut &[u8], len: usize, depth: usize) -> Result<usize, Error> {
    let depth = spend(depth)?;
    let mut values = 1;
    for _ in 0..len {
        values += skip(rest, depth)?;
        values += skip(rest, depth)?;
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::value_count;
    use crate::tests::encode;
    use rmpv::Value;

    /// Skips `input` and reads it with rmpv at the same depth: the same error text, or both
    /// succeed having consumed the same bytes and counted every value.
    fn alike(input: &[u8], depth: usize) {
        let mut skipped = input;
        let mut read = input;
        let skip = skip(&mut skipped, depth);
        let value = rmpv::decode::read_value_with_max_depth(&mut read, depth);
        match (&skip, &value) {
            (Ok(values), Ok(value)) => {
                assert_eq!(skipped.len(), read.len(), "{input:x?}");
                assert_eq!(*values, value_count(value), "{input:x?}");
            }
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{input:x?}"),
            _ => panic!("{input:x?} at depth {depth}: skip {skip:?}, rmpv {value:?}"),
        }
    }

    /// Values of every marker family, nested.
    fn sample() -> Value {
        Value::Array(vec![
            Value::Nil,
            true.into(),
            Value::from(5),
            Value::from(-3),
            Value::from(200u8),
            Value::from(-100i8),
            Value::from(60_000u16),
            Value::from(-30_000i16),
            Value::from(4_000_000_000u32),
            Value::from(-2_000_000_000i32),
            Value::from(u64::MAX),
            Value::from(i64::MIN),
            Value::F32(1.5),
            Value::F64(-2.25),
            "short".into(),
            "x".repeat(40).into(),
            "y".repeat(300).into(),
            Value::Binary(vec![7; 3]),
            Value::Binary(vec![8; 300]),
            Value::Ext(3, vec![1]),
            Value::Ext(-2, vec![1, 2]),
            Value::Ext(4, vec![0; 4]),
            Value::Ext(5, vec![0; 8]),
            Value::Ext(6, vec![0; 16]),
            Value::Ext(7, vec![0; 5]),
            Value::Ext(8, vec![0; 300]),
            Value::Array(vec![]),
            Value::Map(vec![]),
            Value::Map(vec![
                ("k".into(), Value::Array((0..20).map(Value::from).collect())),
                (Value::from(1), Value::Map(vec![(Value::Nil, "v".into())])),
            ]),
        ])
    }

    #[test]
    fn every_marker_at_every_cut_and_depth_is_what_rmpv_reads() {
        let bytes = encode(&sample());
        for depth in [0, 1, 2, 3, 4, 5, 16] {
            for end in 0..=bytes.len() {
                alike(&bytes[..end], depth);
            }
        }
        // Each element alone, whole and cut short, at depths around what it needs.
        let Value::Array(items) = sample() else {
            unreachable!()
        };
        for item in &items {
            let bytes = encode(item);
            for depth in 0..6 {
                for end in 0..=bytes.len() {
                    alike(&bytes[..end], depth);
                }
            }
        }
    }

    #[test]
    fn declared_lengths_past_the_input_and_odd_markers_are_what_rmpv_reads() {
        let cases: &[&[u8]] = &[
            &[0xc1],
            &[0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0],
            &[0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0],
            &[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'],
            &[0xc6, 0xff, 0xff, 0xff, 0xff, 1],
            &[0xc9, 0xff, 0xff, 0xff, 0xff, 1, 2],
            &[0xa3, 0xff, 0xfe, 0xfd],
            &[0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0xc0],
        ];
        for case in cases {
            for depth in [1, 3, 8, 16] {
                alike(case, depth);
            }
        }
    }

    #[test]
    fn a_long_array_of_nils_is_stepped_over_without_keeping_it() {
        let mut bytes = vec![0xdd, 0x00, 0x10, 0x00, 0x00];
        bytes.resize(5 + (1 << 20), 0xc0);
        let mut rest = &bytes[..];
        assert_eq!(skip(&mut rest, 16).unwrap(), 1 + (1 << 20));
        assert!(rest.is_empty());
    }
}
