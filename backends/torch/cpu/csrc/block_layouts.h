/* GGUF blocks as the file stores them, read the same way by every ISA variant.

   A weight [N, K] is N rows of blocks, row after row. Every format is read in chunks of 32 values:
   one chunk per block for the legacy formats (32 values), eight for the K formats (256). A chunk
   decodes to 32 small integers v and a rule w = scale * v + offset, the scale one per chunk (Q6_K:
   one for values 0..15 and one for 16..31) and the offset zero for the symmetric formats.

     Q8_0  34 bytes: f16 d, 32 x int8 v.                                    w = d * v
     Q4_0  18 bytes: f16 d, 16 bytes of nibbles (values 0..15 in the low    w = d * (q - 8)
           nibbles, 16..31 in the high ones).
     Q4_1  20 bytes: f16 d, f16 m, nibbles as Q4_0.                         w = d * q + m
     Q5_0  22 bytes: f16 d, 32 bits (bit j: the fifth bit of value j),      w = d * (q - 16)
           nibbles as Q4_0.
     Q5_1  24 bytes: f16 d, f16 m, 32 bits, nibbles.                        w = d * q + m
     Q4_K  144 bytes: f16 d, f16 dmin, 12 bytes of eight 6-bit scales and   chunk j: w = d*sc_j*q - dmin*m_j
           eight 6-bit mins, 128 bytes of nibbles: 32 bytes per two chunks,
           the low nibbles the first, the high the second.
     Q5_K  176 bytes: as Q4_K, with 32 bytes of fifth bits after the        chunk j: w = d*sc_j*q - dmin*m_j
           scales (bit j of byte l: value l of chunk j) and then the nibbles.
     Q6_K  210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits,     w = d * s_i * (q - 32), sixteen
           16 int8 scales, f16 d. Two halves of 128 values; in half h,       values per scale
           chunk t takes the low (t < 2) or high nibble of 32 bytes at
           64h + 32(t & 1), and bits 2t, 2t+1 of the 32 bytes at 128 + 32h.
*/

#ifndef CANDELABRA_BLOCK_LAYOUTS_H
#define CANDELABRA_BLOCK_LAYOUTS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_abi.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* rows of x multiplied with one decoded chunk (powers of two), and the most of either. The float
   kernel decodes each chunk once for FLOAT_TILE rows: 8 against 4 took 16 and 64 rows of Q5_0, Q6_K
   and Q4_K weights 1.06 to 1.36 times faster (AVX-512 Intel Xeon; 1.10 to 1.30 built as AVX2 alone)
   and left 1 and 4 rows as they were; 16 was no faster than 8. */
#ifndef FLOAT_TILE
#define FLOAT_TILE 8
#endif
#ifndef INT8_TILE
#define INT8_TILE 8
#endif
#define INT8_TILE_BYTES (16 * 1024)
#define ROW_TILE (FLOAT_TILE > INT8_TILE ? FLOAT_TILE : INT8_TILE)
/* bytes of weight rows kept in the cache while every tile of x rows meets them */
#define GROUP_BYTES (96 * 1024)
/* How far ahead of the block being multiplied the float kernel asks for weight bytes (0: not at all).
   The hardware's own prefetch fell behind on a large weight read once: the 151,936 x 896 Q8_0 head
   took 8.0 ms for one row with 8 KiB against 11.3 without (AVX-512 Intel Xeon, 2 threads). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
#ifndef INT8_PREFETCH_BYTES
#define INT8_PREFETCH_BYTES PREFETCH_BYTES
#endif
INLINE int chunks_per_block(const int f) { return VALUES_PER_BLOCK[f] / 32; }
INLINE int is_signed(const int f) { return f == F_Q8_0 || f == F_Q4_0 || f == F_Q5_0 || f == F_Q6_K; }
INLINE int has_offset(const int f) { return f == F_Q4_1 || f == F_Q5_1 || f == F_Q4_K || f == F_Q5_K; }
INLINE int two_scales(const int f) { return f == F_Q6_K; }

/* ---- number formats ---- */

INLINE uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
INLINE uint32_t read_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Ask for the weight bytes `ahead` past a block of `bytes` at `b` (0: nothing; a prefetch never faults,
   past the end of the weight included). */
INLINE void prefetch_ahead(const uint8_t *b, int bytes, const int ahead) {
    if (ahead > 0)
        for (int l = 0; l < bytes; l += 64) __builtin_prefetch(b + ahead + l, 0, 3);
}

INLINE float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24 */
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return bits_float(float_bits(magnitude) | sign);
    }
    if (exponent == 31) return bits_float(sign | 0x7F800000u | ((uint32_t)mantissa << 13));
    return bits_float(sign | ((exponent + 112) << 23) | ((uint32_t)mantissa << 13));
#endif
}

INLINE uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    const uint32_t bits = float_bits(f), sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7FFFFFFF;
    if (magnitude >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (magnitude > 0x7F800000u ? 0x200 : 0));
    if (magnitude >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  /* 65520 and up round to infinity */
    if (magnitude < 0x38800000u)  /* below 2^-14: a multiple of 2^-24, rounded to nearest even */
        return (uint16_t)(sign | (uint32_t)lrintf(bits_float(magnitude) * 16777216.0f));
    const uint32_t rebiased = magnitude - 0x38000000u;
    return (uint16_t)(sign | ((rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13));
#endif
}

INLINE uint16_t float_to_bfloat16(float f) {
    const uint32_t bits = float_bits(f);
    if ((bits & 0x7FFFFFFF) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

INLINE float read_value(const void *p, int dtype, int64_t i) {
    if (dtype == D_F32) return ((const float *)p)[i];
    if (dtype == D_BF16) return bits_float((uint32_t)((const uint16_t *)p)[i] << 16);
    return half_to_float(((const uint16_t *)p)[i]);
}

INLINE void write_value(void *p, int dtype, int64_t i, float v) {
    if (dtype == D_F32) ((float *)p)[i] = v;
    else if (dtype == D_BF16) ((uint16_t *)p)[i] = float_to_bfloat16(v);
    else ((uint16_t *)p)[i] = float_to_half(v);
}

/* ---- a block's scales ---- */

typedef struct {
    float scale[8];     /* per chunk, values 0..15 (all 32 unless two_scales) */
    float scale_hi[8];  /* per chunk, values 16..31 */
    float offset[8];    /* per chunk, added to every value (has_offset formats) */
} block_scales;

/* Q4_K and Q5_K: bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; scales and
   mins 4-7 take their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their top 2
   bits from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins). As four bytes to a word: the eight
   scales in scales[0..1], the eight mins in mins[0..1]. */
INLINE void six_bit_scales(const uint8_t *p, uint32_t scales[2], uint32_t mins[2]) {
    const uint32_t first = read_u32(p), second = read_u32(p + 4), low_bits = read_u32(p + 8);
    scales[0] = first & 0x3F3F3F3Fu;
    scales[1] = (low_bits & 0x0F0F0F0Fu) | ((first >> 2) & 0x30303030u);
    mins[0] = second & 0x3F3F3F3Fu;
    mins[1] = ((low_bits >> 4) & 0x0F0F0F0Fu) | ((second >> 2) & 0x30303030u);
}

INLINE void read_scales(const int f, const uint8_t *b, block_scales *s) {
    switch (f) {
    case F_Q8_0: case F_Q4_0: case F_Q5_0:
        s->scale[0] = s->scale_hi[0] = half_to_float(read_u16(b));
        s->offset[0] = 0.0f;
        break;
    case F_Q4_1: case F_Q5_1:
        s->scale[0] = s->scale_hi[0] = half_to_float(read_u16(b));
        s->offset[0] = half_to_float(read_u16(b + 2));
        break;
    case F_Q4_K: case F_Q5_K: {
        const float d = half_to_float(read_u16(b)), dmin = half_to_float(read_u16(b + 2));
        uint32_t scales[2], mins[2];
        six_bit_scales(b + 4, scales, mins);
        for (int j = 0; j < 8; j++) {
            s->scale[j] = s->scale_hi[j] = d * (float)((scales[j >> 2] >> (8 * (j & 3))) & 0xFF);
            s->offset[j] = -(dmin * (float)((mins[j >> 2] >> (8 * (j & 3))) & 0xFF));
        }
        break;
    }
    case F_Q6_K: {
        const float d = half_to_float(read_u16(b + 208));
        const int8_t *scales = (const int8_t *)(b + 192);
        for (int c = 0; c < 8; c++) {
            s->scale[c] = d * (float)scales[2 * c];
            s->scale_hi[c] = d * (float)scales[2 * c + 1];
            s->offset[c] = 0.0f;
        }
        break;
    }
    }
}

/* ---- a chunk's 32 integers, portable ---- */

INLINE void chunk_values_portable(const int f, const uint8_t *b, int c, int8_t v[32]) {
    switch (f) {
    case F_Q8_0:
        memcpy(v, b + 2, 32);
        break;
    case F_Q4_0: case F_Q4_1: {
        const uint8_t *q = b + (f == F_Q4_0 ? 2 : 4);
        const int shift = f == F_Q4_0 ? 8 : 0;
        for (int l = 0; l < 16; l++) {
            v[l] = (int8_t)((q[l] & 0x0F) - shift);
            v[l + 16] = (int8_t)((q[l] >> 4) - shift);
        }
        break;
    }
    case F_Q5_0: case F_Q5_1: {
        const uint32_t high = read_u32(b + (f == F_Q5_0 ? 2 : 4));
        const uint8_t *q = b + (f == F_Q5_0 ? 6 : 8);
        const int shift = f == F_Q5_0 ? 16 : 0;
        for (int l = 0; l < 16; l++) {
            v[l] = (int8_t)(((q[l] & 0x0F) | (((high >> l) & 1) << 4)) - shift);
            v[l + 16] = (int8_t)(((q[l] >> 4) | (((high >> (l + 16)) & 1) << 4)) - shift);
        }
        break;
    }
    case F_Q4_K: case F_Q5_K: {
        const uint8_t *q = b + (f == F_Q4_K ? 16 : 48) + 32 * (c >> 1);
        const int nibble_shift = (c & 1) * 4;
        for (int l = 0; l < 32; l++) {
            int value = (q[l] >> nibble_shift) & 0x0F;
            if (f == F_Q5_K) value |= ((b[16 + l] >> c) & 1) << 4;
            v[l] = (int8_t)value;
        }
        break;
    }
    case F_Q6_K: {
        const int half = c >> 2, t = c & 3;
        const uint8_t *low = b + 64 * half + 32 * (t & 1), *high = b + 128 + 32 * half;
        const int nibble_shift = (t >> 1) * 4;
        for (int l = 0; l < 32; l++)
            v[l] = (int8_t)((((low[l] >> nibble_shift) & 0x0F) | (((high[l] >> (2 * t)) & 3) << 4)) - 32);
        break;
    }
    }
}
/* ---- rows of the output, one format at a time ---- */

/* An RMS norm the rows of x go through before the product (`gguf_blocks_matmul_normed`). */
typedef struct {
    const void *residual;  /* [M, K], added to x first, or NULL */
    void *summed;          /* [M, K]: x + residual, rounded to the dtype, where residual is given */
    const void *weight;    /* [K]: each normalised value times weight + offset */
    float eps, offset;
} pre_norm;

/* What a call multiplies: the weight, x as the kernel reads it, and where the output goes. */
typedef struct {
    const uint8_t *blocks;
    int64_t N, K, row_bytes, M;
    const pre_norm *norm;  /* or NULL */
    int gated;  /* x is a gated MLP's [gate | up] rows, [M, 2K]: the product reads silu(gate) * up */
    const float *x;  /* float kernel: float32 [M, K] */
    const int8_t *xq;  /* int8 kernel: [M, K], with scales and sums [M, K / 32] */
    const float *x_scale, *x_sum;
    void *out;  /* [M, N] in out_dtype */
    int out_dtype;
    int in_dtype;  /* of the x given, which `x` holds converted where it is not D_F32 */
} product;

/* The rows of x one decoded weight chunk meets: the kernel's tile, else the largest power of two
   left, so that only a few row counts are compiled (each with its loops unrolled). */
INLINE int tile_rows(const int kernel, int64_t left, int64_t K) {
    /* the tile's int8 rows of x stay in the first-level cache: 8 rows of 4864 did not (Zen 3, 32 KiB) */
    const int tile = kernel == KERNEL_FLOAT ? FLOAT_TILE : K * INT8_TILE <= INT8_TILE_BYTES ? INT8_TILE : 4;
    return left >= tile ? tile : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

#endif
