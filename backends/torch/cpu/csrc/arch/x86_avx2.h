/* AVX2 with FMA and F16C: each chunk's integers gathered 32 bytes at a time, the float kernel's
   products with FMAs, and the int8 kernel's with maddubs, as llama.cpp multiplies. The AVX-512 variant
   takes all of this but the float kernel. */

#ifndef CANDELABRA_X86_AVX2_H
#define CANDELABRA_X86_AVX2_H

#include <immintrin.h>

#include "../block_layouts.h"

/* ---- a chunk's 32 integers, AVX2 ---- */

/* 16 bytes of nibbles to 32 values: the low nibbles first, then the high ones */
INLINE __m256i nibbles(const uint8_t *p) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

/* 32 bits to 32 bytes: 0xFF where bit j is set */
INLINE __m256i bit_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

/* bytes' 4-bit halves: the low nibble (0) or the high one (1) of 32 bytes */
INLINE __m256i nibble_of(const uint8_t *p, int high) {
    __m256i q = _mm256_loadu_si256((const __m256i *)p);
    if (high) q = _mm256_srli_epi16(q, 4);
    return _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
}

INLINE __m256i chunk_values(const int f, const uint8_t *b, int c) {
    switch (f) {
    case F_Q8_0:
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    case F_Q4_0:
        return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    case F_Q4_1:
        return nibbles(b + 4);
    case F_Q5_0:  /* a clear fifth bit is q - 16: 0xF0 | q as int8 */
        return _mm256_or_si256(nibbles(b + 6), _mm256_andnot_si256(bit_bytes(read_u32(b + 2)),
                                                                   _mm256_set1_epi8((char)0xF0)));
    case F_Q5_1:
        return _mm256_or_si256(nibbles(b + 8), _mm256_and_si256(bit_bytes(read_u32(b + 4)), _mm256_set1_epi8(0x10)));
    case F_Q4_K:
        return nibble_of(b + 16 + 32 * (c >> 1), c & 1);
    case F_Q5_K: {
        const __m256i high = _mm256_and_si256(
            _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), _mm_cvtsi32_si128(c)),
            _mm256_set1_epi8(1));
        return _mm256_or_si256(nibble_of(b + 48 + 32 * (c >> 1), c & 1), _mm256_slli_epi16(high, 4));
    }
    default: {  /* F_Q6_K */
        const int half = c >> 2, t = c & 3;
        const __m256i low = nibble_of(b + 64 * half + 32 * (t & 1), t >> 1);
        const __m256i high = _mm256_and_si256(
            _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half)), _mm_cvtsi32_si128(2 * t)),
            _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    }
    }
}

INLINE float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A chunk's 32 integers as four vectors of 8 float32 */
INLINE void chunk_integers(const int f, const uint8_t *b, int c, __m256 q[4]) {
    if (f == F_Q8_0) {  /* straight from the block: cheaper than widening a register */
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k))));
        return;
    }
    const __m256i v = chunk_values(f, b, c);
    const __m128i low = _mm256_castsi256_si128(v), high = _mm256_extracti128_si256(v, 1);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8)));
}

/* A chunk's 32 weights as four vectors of 8 float32: its integers scaled, plus the offset */
INLINE void chunk_floats(const int f, const uint8_t *b, const block_scales *s, int c, __m256 w[4]) {
    chunk_integers(f, b, c, w);
    const __m256 scale = _mm256_set1_ps(s->scale[c]), scale_hi = _mm256_set1_ps(s->scale_hi[c]);
    const __m256 offset = _mm256_set1_ps(s->offset[c]);
    for (int k = 0; k < 4; k++) w[k] = _mm256_fmadd_ps(w[k], k < 2 ? scale : scale_hi, offset);
}
/* ---- int8 kernel: one weight row against `rows` rows of x as int8 blocks of 32 ---- */

/* The integer dot products of four chunks summed within each half: lanes 0-3 values 0..15 of chunks
   0-3, lanes 4-7 values 16..31 (the halves Q6_K scales apart). */
INLINE __m256i four_dots(const int f, const __m256i v[4], const __m256i magnitude[4], const int8_t *x) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dot[4];
    for (int k = 0; k < 4; k++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * k));
        /* maddubs multiplies unsigned by signed bytes: a signed weight gives its magnitude, and x its sign */
        if (is_signed(f)) xv = _mm256_sign_epi8(xv, v[k]);
        dot[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[k], xv), ones);
    }
    return _mm256_hadd_epi32(_mm256_hadd_epi32(dot[0], dot[1]), _mm256_hadd_epi32(dot[2], dot[3]));
}

/* four consecutive float16 fields, `stride` bytes apart, as float32 */
INLINE __m128 four_halves(const uint8_t *p, int stride) {
    return _mm_cvtph_ps(_mm_setr_epi16((short)read_u16(p), (short)read_u16(p + stride), (short)read_u16(p + 2 * stride),
                                       (short)read_u16(p + 3 * stride), 0, 0, 0, 0));
}

/* A K block's eight chunk scales (Q6_K: for values 0..15, and in scale_hi for 16..31) and offsets,
   made in registers: read back from memory right after scalar stores, they stall on store forwarding. */
typedef struct {
    __m256 scale, scale_hi, offset;
} block_vectors;

INLINE void read_scale_vectors(const int f, const uint8_t *b, block_vectors *s) {
    if (f == F_Q6_K) {
        const __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m128i even_odd = _mm_shuffle_epi8(scales, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14,
                                                                        1, 3, 5, 7, 9, 11, 13, 15));
        const __m256 d = _mm256_set1_ps(half_to_float(read_u16(b + 208)));
        s->scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(even_odd)));
        s->scale_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(even_odd, 8))));
        s->offset = _mm256_setzero_ps();
    } else {  /* Q4_K, Q5_K */
        uint32_t scales[2], mins[2];
        six_bit_scales(b + 4, scales, mins);
        const __m256 d = _mm256_set1_ps(half_to_float(read_u16(b)));
        const __m256 dmin = _mm256_set1_ps(-half_to_float(read_u16(b + 2)));
        s->scale = s->scale_hi = _mm256_mul_ps(
            d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)scales[0], (int)scales[1], 0, 0))));
        s->offset = _mm256_mul_ps(
            dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)mins[0], (int)mins[1], 0, 0))));
    }
}

INLINE __m128 half_of(__m256 v, int high) { return high ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v); }

INLINE void int8_tile(const int f, const int rows, const uint8_t *w_row, const int8_t *xq, const float *x_scale,
                      const float *x_sum, int64_t K, float *result) {
    const int64_t chunks = K / 32;
    const int per_block = chunks_per_block(f);
    __m256 acc[ROW_TILE];
    __m128 offsets[ROW_TILE];
    for (int m = 0; m < rows; m++) {
        acc[m] = _mm256_setzero_ps();
        offsets[m] = _mm_setzero_ps();
    }
    block_scales s;
    block_vectors sv = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};  /* read at c == 0 */
    int64_t j = 0;
    /* four chunks at a time: four blocks of a legacy format, or half a K block */
    for (; j + 4 <= chunks; j += 4) {
        const uint8_t *b = w_row + (j / per_block) * BYTES_PER_BLOCK[f];
        const int c = (int)(j % per_block);
        if (per_block == 1) prefetch_ahead(b, 4 * BYTES_PER_BLOCK[f], INT8_PREFETCH_BYTES);
        else if (c == 0) prefetch_ahead(b, BYTES_PER_BLOCK[f], INT8_PREFETCH_BYTES);
        __m128 scale, scale_hi, offset = _mm_setzero_ps();
        if (per_block == 1) {
            scale = scale_hi = four_halves(b, BYTES_PER_BLOCK[f]);
            if (has_offset(f)) offset = four_halves(b + 2, BYTES_PER_BLOCK[f]);
        } else {
            if (c == 0) read_scale_vectors(f, b, &sv);
            scale = half_of(sv.scale, c);
            scale_hi = half_of(sv.scale_hi, c);
            offset = half_of(sv.offset, c);
        }
        __m256i v[4], magnitude[4];
        for (int k = 0; k < 4; k++) {
            v[k] = per_block == 1 ? chunk_values(f, b + k * BYTES_PER_BLOCK[f], 0) : chunk_values(f, b, c + k);
            magnitude[k] = is_signed(f) ? _mm256_abs_epi8(v[k]) : v[k];
        }
        for (int m = 0; m < rows; m++) {
            const __m256 dots = _mm256_cvtepi32_ps(four_dots(f, v, magnitude, xq + m * K + 32 * j));
            const __m128 xs = _mm_loadu_ps(x_scale + m * chunks + j);
            acc[m] = _mm256_fmadd_ps(dots, _mm256_set_m128(_mm_mul_ps(scale_hi, xs), _mm_mul_ps(scale, xs)), acc[m]);
            if (has_offset(f)) offsets[m] = _mm_fmadd_ps(offset, _mm_loadu_ps(x_sum + m * chunks + j), offsets[m]);
        }
    }
    /* the last one to three chunks of a legacy format */
    for (; j < chunks; j++) {
        const uint8_t *b = w_row + j * BYTES_PER_BLOCK[f];
        read_scales(f, b, &s);
        const __m256i v = chunk_values(f, b, 0);
        const __m256i magnitude = is_signed(f) ? _mm256_abs_epi8(v) : v;
        for (int m = 0; m < rows; m++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + 32 * j));
            if (is_signed(f)) xv = _mm256_sign_epi8(xv, v);
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xv), _mm256_set1_epi16(1));
            const __m256 scale = _mm256_set1_ps(s.scale[0] * x_scale[m * chunks + j]);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
            if (has_offset(f))
                offsets[m] = _mm_add_ss(offsets[m], _mm_set_ss(s.offset[0] * x_sum[m * chunks + j]));
        }
    }
    for (int m = 0; m < rows; m++) {
        __m128 o = _mm_add_ps(offsets[m], _mm_movehl_ps(offsets[m], offsets[m]));
        o = _mm_add_ss(o, _mm_movehdup_ps(o));
        result[m] = horizontal_sum(acc[m]) + _mm_cvtss_f32(o);
    }
}

/* one row of x to int8 blocks of 32: q = round(x / scale), scale = max |x| / 127; also each block's sum */
INLINE void quantize_row(const float *x, int64_t K, int8_t *q, float *scale, float *sum) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t j = 0; j < K / 32; j++) {
        __m256 v[4];
        __m256 largest = _mm256_setzero_ps(), total = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 32 * j + 8 * k);
            largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign_bit, v[k]));
            total = _mm256_add_ps(total, v[k]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        scale[j] = amax / 127.0f;
        sum[j] = horizontal_sum(total);
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i i32[4];
        for (int k = 0; k < 4; k++) i32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
        const __m256i i16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * j), _mm256_permutevar8x32_epi32(i16, order));
    }
}

INLINE void decode_chunk(const int f, const uint8_t *b, const block_scales *s, int c, float *out) {
    __m256 w[4];
    chunk_floats(f, b, s, c, w);
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + 8 * k, w[k]);
}
#endif
