//! A self-signed certificate made at start when `--secure-serving` has no `--cert-path`, as
//! the Go EPP does: ECDSA P-256 with SHA-256, valid from an hour ago for ten years, for
//! `localhost`/127.0.0.1 (clients of a self-signed certificate do not verify it anyway).
//!
//! NOTE: the DER is written by hand (about a page of ASN.1) with `ring`, which kvpick
//! already links through kube, instead of adding a certificate crate (rcgen and its date
//! crates) for one fixed structure.

use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Why no certificate could be made (the system RNG or ring failed).
#[derive(Debug, thiserror::Error)]
#[error("cannot make a self-signed certificate: {0}")]
pub struct SelfSignedError(&'static str);

const ECDSA_WITH_SHA256: &[u8] = &[0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x04, 0x03, 0x02];
const EC_PUBLIC_KEY: &[u8] = &[0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x02, 0x01];
const PRIME256V1: &[u8] = &[0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x03, 0x01, 0x07];
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
const SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1D, 0x11];

/// One DER element: tag, definite length, contents.
fn der(tag: u8, contents: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = contents.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        let significant = bytes.get(skip..).unwrap_or_default();
        out.push(0x80 | significant.len() as u8);
        out.extend_from_slice(significant);
    }
    out.extend_from_slice(contents);
    out
}

fn sequence(parts: &[&[u8]]) -> Vec<u8> {
    der(0x30, &parts.concat())
}

fn oid(value: &[u8]) -> Vec<u8> {
    der(0x06, value)
}

/// `YYMMDDHHMMSSZ` (UTCTime; fine until 2050).
fn utc_time(seconds: i64) -> Vec<u8> {
    let days = seconds.div_euclid(86_400);
    let secs = seconds.rem_euclid(86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let text = format!(
        "{:02}{month:02}{day:02}{:02}{:02}{:02}Z",
        year % 100,
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    );
    der(0x17, text.as_bytes())
}

fn name() -> Vec<u8> {
    let attribute = sequence(&[&oid(COMMON_NAME), &der(0x0C, b"kvpick")]);
    sequence(&[&der(0x31, &attribute)])
}

/// A fresh key and a certificate for it, signed by itself.
pub fn generate() -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), SelfSignedError> {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
        .map_err(|_| SelfSignedError("key generation"))?;
    let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref(), &rng)
        .map_err(|_| SelfSignedError("key parsing"))?;
    let mut serial = [0u8; 16];
    rng.fill(&mut serial)
        .map_err(|_| SelfSignedError("serial number"))?;
    serial[0] &= 0x7F; // positive
    serial[0] |= 0x01; // and no leading zero byte to strip
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    let algorithm = sequence(&[&oid(ECDSA_WITH_SHA256)]);
    let public_key = {
        let mut bits = vec![0u8];
        bits.extend_from_slice(key.public_key().as_ref());
        sequence(&[
            &sequence(&[&oid(EC_PUBLIC_KEY), &oid(PRIME256V1)]),
            &der(0x03, &bits),
        ])
    };
    let alt_names = sequence(&[&der(0x82, b"localhost"), &der(0x87, &[127, 0, 0, 1])]);
    let extensions = der(
        0xA3,
        &sequence(&[&sequence(&[&oid(SUBJECT_ALT_NAME), &der(0x04, &alt_names)])]),
    );
    let tbs = sequence(&[
        &der(0xA0, &der(0x02, &[2])),
        &der(0x02, &serial),
        &algorithm,
        &name(),
        &sequence(&[&utc_time(now - 3600), &utc_time(now + 10 * 365 * 86_400)]),
        &name(),
        &public_key,
        &extensions,
    ]);
    let signature = key
        .sign(&rng, &tbs)
        .map_err(|_| SelfSignedError("signing"))?;
    let mut bits = vec![0u8];
    bits.extend_from_slice(signature.as_ref());
    let certificate = sequence(&[&tbs, &algorithm, &der(0x03, &bits)]);
    Ok((
        CertificateDer::from(certificate),
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(pkcs8.as_ref().to_vec())),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_time_matches_known_dates() {
        assert_eq!(&utc_time(0)[2..], b"700101000000Z");
        assert_eq!(&utc_time(951_782_400)[2..], b"000229000000Z");
        assert_eq!(&utc_time(1_798_761_599)[2..], b"261231235959Z");
    }

    #[test]
    fn long_lengths_use_the_long_form() {
        assert_eq!(&der(0x04, &[0; 200])[..3], &[0x04, 0x81, 200]);
        assert_eq!(&der(0x04, &[0; 300])[..4], &[0x04, 0x82, 0x01, 0x2C]);
    }
}
