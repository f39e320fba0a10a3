//! MXFP4 (OCP microscaling): blocks of 32 FP4 E2M1 values sharing one E8M0 exponent.
//!
//! Layout as in Hugging Face GPT-OSS checkpoints: per output row, `cols / 32` blocks of 16 bytes
//! and `cols / 32` scale bytes. Byte `j` of a block holds element `2j` in its low nibble and
//! element `2j + 1` in its high nibble; a value is `FP4[nibble] * 2^(scale - 127)`.
//! Every decoded value is exact in f32.

/// Values per block.
pub const BLOCK: usize = 32;
/// Bytes per block of packed nibbles.
pub const BLOCK_BYTES: usize = 16;

/// FP4 E2M1 nibble -> value (bit 3 is the sign).
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(s - 127)` for every E8M0 byte `s`, as torch's `ldexp` gives it in f32 (`s = 0` is the
/// subnormal 2^-127, `s = 255` overflows to infinity).
pub const fn scale_value(s: u8) -> f32 {
    if s == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits((s as u32) << 23)
    }
}

/// [`scale_value`] for every byte.
pub static SCALE_LUT: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut s = 0;
    while s < 256 {
        t[s] = scale_value(s as u8);
        s += 1;
    }
    t
};

/// The 16 FP4 values times one scale, for every scale byte: row `s` is
/// `FP4_VALUES[i] * SCALE_LUT[s]`, the products a decoder would otherwise form per block.
/// Aligned so that a row is one 64-byte line.
#[repr(C, align(64))]
pub struct ScaledFp4(pub [[f32; 16]; 256]);

/// [`ScaledFp4`], built on first use (at run time, so the products are the ones the CPU's
/// multiply gives, NaN bits included).
pub fn scaled_fp4() -> &'static ScaledFp4 {
    static TABLE: std::sync::OnceLock<Box<ScaledFp4>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new(ScaledFp4([[0.0; 16]; 256]));
        for (row, &scale) in t.0.iter_mut().zip(SCALE_LUT.iter()) {
            for (v, &q) in row.iter_mut().zip(&FP4_VALUES) {
                *v = std::hint::black_box(q) * scale;
            }
        }
        t
    })
}

/// The scale table (kept as a function for call sites that want a reference).
pub fn scale_table() -> &'static [f32; 256] {
    &SCALE_LUT
}

/// Decodes one row: `blocks` holds `out.len() / 32` blocks of 16 bytes, `scales` one byte per block.
#[inline(always)]
pub fn decode_row(blocks: &[u8], scales: &[u8], scale_lut: &[f32; 256], out: &mut [f32]) {
    for ((block, &s), out) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(scales)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let scale = scale_lut[s as usize];
        for (j, &b) in block.iter().enumerate() {
            out[2 * j] = FP4_VALUES[(b & 0x0f) as usize] * scale;
            out[2 * j + 1] = FP4_VALUES[(b >> 4) as usize] * scale;
        }
    }
}

/// Quantizes one row of f32 values to MXFP4 (round to nearest representable value, shared
/// exponent chosen so the largest magnitude fits). Used by `afd synth` and by tests.
pub fn quantize_row(values: &[f32], blocks: &mut [u8], scales: &mut [u8]) {
    for ((vals, block), scale) in values
        .chunks_exact(BLOCK)
        .zip(blocks.chunks_exact_mut(BLOCK_BYTES))
        .zip(scales.iter_mut())
    {
        let max = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Largest FP4 magnitude is 6 = 1.5 * 2^2: pick e so that max / 2^e <= 6.
        let e = if max > 0.0 {
            (max / 6.0).log2().ceil().clamp(-127.0, 127.0) as i32
        } else {
            0
        };
        *scale = (e + 127) as u8;
        let inv = 1.0 / scale_value(*scale);
        let code = |v: f32| -> u8 {
            let x = v * inv;
            let mut best = 0u8;
            let mut best_err = f32::INFINITY;
            for (i, &q) in FP4_VALUES.iter().enumerate() {
                let err = (q - x).abs();
                if err < best_err {
                    best_err = err;
                    best = i as u8;
                }
            }
            best
        };
        for (j, b) in block.iter_mut().enumerate() {
            *b = code(vals[2 * j]) | (code(vals[2 * j + 1]) << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_rows_are_the_values_times_each_scale() {
        let table = scaled_fp4();
        for (s, row) in table.0.iter().enumerate() {
            assert_eq!(
                row.as_ptr() as usize % 64,
                0,
                "row {s} is not one cache line"
            );
            for (i, v) in row.iter().enumerate() {
                let want = FP4_VALUES[i] * SCALE_LUT[s];
                // 0 x the overflowed scale 255 is NaN, whose bits a compiler may fold
                // differently from the CPU's multiply.
                if want.is_nan() {
                    assert!(v.is_nan(), "scale {s}, value {i}");
                } else {
                    assert_eq!(v.to_bits(), want.to_bits(), "scale {s}, value {i}");
                }
            }
        }
    }

    #[test]
    fn nibble_order_and_scale() {
        // Byte 0x21: element 0 = nibble 1 (0.5), element 1 = nibble 2 (1.0); scale 128 -> x2.
        let mut blocks = [0u8; 16];
        blocks[0] = 0x21;
        blocks[15] = 0xf8; // element 30 = -0.0, element 31 = -6.0
        let mut out = [0f32; 32];
        decode_row(&blocks, &[128], scale_table(), &mut out);
        assert_eq!(out[0], 1.0);
        assert_eq!(out[1], 2.0);
        assert_eq!(out[30], 0.0);
        assert!(out[30].is_sign_negative());
        assert_eq!(out[31], -12.0);
        assert!(out[2..30].iter().all(|v| *v == 0.0));
    }

    #[test]
    fn quantize_then_decode_is_exact_on_representable_values() {
        let values: Vec<f32> = (0..64).map(|i| FP4_VALUES[i % 16] * 0.25).collect();
        let mut blocks = vec![0u8; 32];
        let mut scales = vec![0u8; 2];
        quantize_row(&values, &mut blocks, &mut scales);
        let mut out = vec![0f32; 64];
        decode_row(&blocks, &scales, scale_table(), &mut out);
        for (a, b) in values.iter().zip(&out) {
            assert_eq!(a, b);
        }
    }

    #[test]
    fn extreme_scales() {
        assert_eq!(scale_value(127), 1.0);
        assert_eq!(scale_value(0), 2f32.powi(-127));
        assert!(scale_value(255).is_infinite());
    }
}
