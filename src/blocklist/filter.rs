//! The Bloom filter's math, free of I/O: its size from the expected number of items and the
//! false-positive rate, and the bits a key sets.
//!
//! For `n` items and a false-positive rate `p`, the optimal filter uses `k = round(log2(1/p))`
//! hash functions; its rate with `m` bits is `(1 - e^(-kn/m))^k`, so it takes
//! `m = ceil(-k n / ln(1 - q^(1/k)))` bits for a rate `q`. The filter is sized for
//! `q = 0.9 p`: rounding `k` and real hashes then still leave the measured rate under `p` at
//! `n` items, with about 2 % more bits than the textbook `-n ln p / (ln 2)^2`. A key's
//! `k` bit positions come from one BLAKE3 hash split into two 64-bit halves `h1` and `h2`:
//! position `i` is `(h1 + i * h2) mod m` (Kirsch and Mitzenmacher's double hashing, which keeps
//! the false-positive rate of `k` independent hashes). BLAKE3 gives the same positions on
//! every instance and every platform. Bits are numbered as Redis `SETBIT` numbers them: bit `o`
//! is the bit `0x80 >> (o % 8)` of byte `o / 8`.

use crate::Key;

/// A filter's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Bits in the array.
    pub(crate) bits: u64,
    /// Hash functions (bits per key).
    pub(crate) hashes: u32,
}

impl Shape {
    /// The optimal shape for `items` keys at false-positive rate `rate` (0 < rate < 1).
    pub(crate) fn for_items(items: u64, rate: f64) -> Shape {
        let hashes = (-rate.log2()).round().clamp(1.0, 32.0) as u32;
        let target = 0.9 * rate;
        let k = f64::from(hashes);
        let bits = (-k * items as f64 / (1.0 - target.powf(1.0 / k)).ln()).ceil();
        Shape {
            bits: bits.max(8.0) as u64,
            hashes,
        }
    }

    /// The false-positive rate at `items` keys, in theory.
    #[cfg(test)]
    fn rate_at(self, items: u64) -> f64 {
        let k = f64::from(self.hashes);
        (1.0 - (-k * items as f64 / self.bits as f64).exp()).powf(k)
    }

    /// The bit positions of `key`.
    pub(crate) fn positions(self, key: &Key) -> impl Iterator<Item = u64> {
        let hash = blake3::hash(key.as_str().as_bytes());
        let bytes = hash.as_bytes();
        let half = |i: usize| {
            let mut word = [0; 8];
            word.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(word)
        };
        let (h1, h2) = (half(0), half(8));
        (0..u64::from(self.hashes)).map(move |i| h1.wrapping_add(i.wrapping_mul(h2)) % self.bits)
    }

    /// Whether every bit of `key` is set in `array` (a copy of the Redis string): "maybe".
    /// Bits past the end of the array read as unset, as Redis reads them.
    pub(crate) fn maybe_contains(self, array: &[u8], key: &Key) -> bool {
        self.positions(key).all(|o| is_set(array, o))
    }
}

/// Bit `o` of `array`, as Redis `GETBIT` reads it.
pub(crate) fn is_set(array: &[u8], o: u64) -> bool {
    let byte = usize::try_from(o / 8).ok().and_then(|i| array.get(i));
    byte.is_some_and(|b| b & (0x80 >> (o % 8)) != 0)
}

/// Sets bit `o` of `array`, growing it as Redis `SETBIT` does.
pub(crate) fn set(array: &mut Vec<u8>, o: u64) {
    let index = usize::try_from(o / 8).unwrap_or(usize::MAX);
    if index >= array.len() {
        array.resize(index + 1, 0);
    }
    array[index] |= 0x80 >> (o % 8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_follows_the_formulas() {
        // 100 000 items at 1 %: 980 697 bits (120 KiB) and 7 hashes, 0.9 % in theory.
        let shape = Shape::for_items(100_000, 0.01);
        assert_eq!(shape.hashes, 7);
        assert_eq!(shape.bits, 980_697);
        assert!((shape.rate_at(100_000) - 0.009).abs() < 1e-6);
        assert_eq!(Shape::for_items(1_000, 0.001).hashes, 10);
    }

    #[test]
    fn added_keys_are_always_found_and_others_rarely() {
        let shape = Shape::for_items(10_000, 0.01);
        let mut array = Vec::new();
        for i in 0..10_000 {
            for o in shape.positions(&Key::from(format!("blocked-{i}"))) {
                set(&mut array, o);
            }
        }
        assert!(
            (0..10_000).all(|i| shape.maybe_contains(&array, &Key::from(format!("blocked-{i}"))))
        );
        let false_positives = (0..100_000)
            .filter(|i| shape.maybe_contains(&array, &Key::from(format!("other-{i}"))))
            .count();
        // 0.9 % of 100 000 is 900; the binomial spread is about 30.
        assert!(
            (780..=1_000).contains(&false_positives),
            "{false_positives}"
        );
    }

    #[test]
    fn bit_order_is_redis_order() {
        let mut array = Vec::new();
        set(&mut array, 0);
        set(&mut array, 9);
        assert_eq!(array, [0x80, 0x40]);
        assert!(is_set(&array, 9) && !is_set(&array, 8) && !is_set(&array, 1000));
    }
}
