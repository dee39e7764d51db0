/* x @ W.T with W read in its GGUF quantized blocks, as the file stores them, on a CPU.

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

   Two kernels, both reading each weight row once per call for all rows of x:

     float  x in float32 (converted once from bfloat16 or float16); each chunk's integers widened
            to float32, multiplied by x and summed with FMAs, then times the chunk's scale, and the
            offset times the chunk's sum of x: exact to float32 rounding.
     int8   each row of x rounded once per call to int8 in blocks of 32 with a float scale, then
            integer dot products of 32 values at a time; the offset term multiplies the exact sum
            of x over the chunk. Error about that of rounding x to 8 bits.

   Rows of the output are spread over threads with OpenMP, which should be the process's one
   OpenMP runtime (torch's): the Python side links against it. Without OpenMP it runs on one
   thread. The vector code is AVX2 with FMA; elsewhere (or with GB_PORTABLE) plain C. Where the
   compiler targets AVX-512, the float kernel decodes each chunk's weights to float32 once (scale and
   offset applied) for 4 weight rows at a time (2 beside 8 rows of x), so that each load of x feeds
   that many rows' FMAs: 1.4 to 1.6 times the AVX2 kernel at 16 and 64 rows of x, level at one.
*/

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(GB_PORTABLE)
#define GB_AVX2 1
#else
#define GB_AVX2 0
#endif
#if GB_AVX2 && defined(__AVX512F__)
#define GB_AVX512 1
#else
#define GB_AVX512 0
#endif
#if defined(__F16C__) && !defined(GB_PORTABLE)
#define GB_F16C 1
#else
#define GB_F16C 0
#endif
#if GB_AVX2 || GB_F16C
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

enum { F_Q8_0, F_Q4_0, F_Q4_1, F_Q5_0, F_Q5_1, F_Q4_K, F_Q5_K, F_Q6_K, FORMAT_COUNT };
enum { D_F32, D_BF16, D_F16 };
enum { KERNEL_FLOAT, KERNEL_INT8 };
enum { OK = 0, BAD_FORMAT = -1, BAD_SHAPE = -2, BAD_DTYPE = -3, BAD_ROW = -4, NO_MEMORY = -5, BAD_KERNEL = -6 };

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

static const int VALUES_PER_BLOCK[FORMAT_COUNT] = {32, 32, 32, 32, 32, 256, 256, 256};
static const int BYTES_PER_BLOCK[FORMAT_COUNT] = {34, 18, 20, 22, 24, 144, 176, 210};

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
#if GB_F16C
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
#if GB_F16C
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

#if GB_AVX2

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

#if GB_AVX512

/* ---- float kernel, AVX-512: weight rows against rows of x (float32, row stride K) ---- */

/* 16 bytes as 16 int32 lanes */
INLINE __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* A chunk's 32 integers as int32 lanes, values 0..15 in q[0] and 16..31 in q[1]; Q4_0 and Q5_0 leave in
   the bias they subtract (8, 16), which the chunk's offset takes away. */
INLINE void chunk_lanes(const int f, const uint8_t *b, int c, __m512i q[2]) {
    const __m512i low_nibble = _mm512_set1_epi32(0x0F);
    switch (f) {
    case F_Q8_0:
        q[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
        q[1] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
        return;
    case F_Q4_0: case F_Q4_1: case F_Q5_0: case F_Q5_1: {
        const int nibbles_at = f == F_Q4_0 ? 2 : f == F_Q4_1 ? 4 : f == F_Q5_0 ? 6 : 8;
        const __m512i n = bytes16(b + nibbles_at);
        q[0] = _mm512_and_si512(n, low_nibble);
        q[1] = _mm512_srli_epi32(n, 4);
        if (f == F_Q5_0 || f == F_Q5_1) {  /* bit j of the word: the fifth bit of value j */
            const uint32_t bits = read_u32(b + (f == F_Q5_0 ? 2 : 4));
            const __m512i sixteen = _mm512_set1_epi32(16);
            q[0] = _mm512_mask_or_epi32(q[0], (__mmask16)(bits & 0xFFFF), q[0], sixteen);
            q[1] = _mm512_mask_or_epi32(q[1], (__mmask16)(bits >> 16), q[1], sixteen);
        }
        return;
    }
    case F_Q4_K: {
        const uint8_t *p = b + 16 + 32 * (c >> 1);
        for (int h = 0; h < 2; h++)  /* bytes widened with zeros: their high nibble needs no mask */
            q[h] = c & 1 ? _mm512_srli_epi32(bytes16(p + 16 * h), 4) : _mm512_and_si512(bytes16(p + 16 * h), low_nibble);
        return;
    }
    default: {  /* Q5_K and Q6_K: their bits are gathered faster as bytes, 32 at a time */
        const __m256i v = chunk_values(f, b, c);
        q[0] = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(v));
        q[1] = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1));
        return;
    }
    }
}

/* What a format subtracts from its stored integers before scaling: the offset (scale times minus this)
   does it in the same FMA that scales them. */
INLINE float bias(const int f) { return f == F_Q4_0 ? 8.0f : f == F_Q5_0 ? 16.0f : 0.0f; }

/* A chunk's 32 weights as two vectors of 16 float32 (values 0..15, 16..31): its integers scaled and
   offset once for all the tile's rows, so that each row then costs two FMAs a chunk. */
INLINE void chunk_weights(const int f, const uint8_t *b, int c, __m512 scale, __m512 scale_hi, __m512 offset,
                          __m512 w[2]) {
    __m512i q[2];
    chunk_lanes(f, b, c, q);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[0]), scale, offset);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[1]), scale_hi, offset);
}

/* A legacy format's row (one chunk a block): each block's scale and offset as float32, converted
   sixteen at a time, into tables of a multiple of 16. Broadcast from these in the chunk loop, each
   costs a load there instead of a conversion and two shuffles on the ports the vector work needs. */
INLINE void legacy_scales(const int f, const uint8_t *w_row, int64_t blocks, float *scale, float *offset) {
    for (int64_t i0 = 0; i0 < blocks; i0 += 16) {
        uint16_t d[16] = {0}, m[16] = {0};
        for (int j = 0; j < 16 && i0 + j < blocks; j++) {
            d[j] = read_u16(w_row + (i0 + j) * BYTES_PER_BLOCK[f]);
            if (has_offset(f)) m[j] = read_u16(w_row + (i0 + j) * BYTES_PER_BLOCK[f] + 2);
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m));
        _mm512_storeu_ps(scale + i0, dv);
        _mm512_storeu_ps(offset + i0, _mm512_fnmadd_ps(dv, _mm512_set1_ps(bias(f)), mv));
    }
}

/* Weight rows a float tile decodes together, so that each load of x feeds that many rows' FMAs: 4
   beside up to 4 rows of x, 2 beside 8 (16 sums in registers either way). */
#define WIDE_W_ROWS 4
INLINE int weight_rows_beside(const int rows) { return rows >= 8 ? 2 : WIDE_W_ROWS; }

/* Each (weight row, x row) pair has one sum, taking a chunk's two halves in turn, whatever rows share
   its tile: a row's result does not depend on the rows beside it, of x or of the weight. */
INLINE void multiply_chunk(const int R, const int T, __m512 w[WIDE_W_ROWS][2], const float *xc, int64_t K,
                           __m512 acc[WIDE_W_ROWS][FLOAT_TILE]) {
    for (int t = 0; t < T; t++) {
        const __m512 x0 = _mm512_loadu_ps(xc + t * K), x1 = _mm512_loadu_ps(xc + t * K + 16);
        for (int r = 0; r < R; r++) {
            acc[r][t] = _mm512_fmadd_ps(w[r][0], x0, acc[r][t]);
            acc[r][t] = _mm512_fmadd_ps(w[r][1], x1, acc[r][t]);
        }
    }
}

/* R weight rows (row_bytes apart) against T rows of x: result[t * R + r]. */
INLINE void float_tile(const int f, const int R, const int T, const uint8_t *w_row, int64_t row_bytes,
                       const float *x, int64_t K, float *result) {
    __m512 acc[WIDE_W_ROWS][FLOAT_TILE], w[WIDE_W_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    const int64_t blocks = K / VALUES_PER_BLOCK[f];
    if (chunks_per_block(f) == 1) {
        const int64_t padded = (blocks + 15) / 16 * 16;
        float scale[WIDE_W_ROWS][padded], offset[WIDE_W_ROWS][padded];
        for (int r = 0; r < R; r++) legacy_scales(f, w_row + r * row_bytes, blocks, scale[r], offset[r]);
        for (int64_t i = 0; i < blocks; i++) {
            for (int r = 0; r < R; r++) {
                const uint8_t *b = w_row + r * row_bytes + i * BYTES_PER_BLOCK[f];
                const __m512 d = _mm512_set1_ps(scale[r][i]), o = _mm512_set1_ps(offset[r][i]);
                prefetch_ahead(b, BYTES_PER_BLOCK[f], PREFETCH_BYTES);
                chunk_weights(f, b, 0, d, d, o, w[r]);
            }
            multiply_chunk(R, T, w, x + 32 * i, K, acc);
        }
    } else {
        for (int64_t i = 0; i < blocks; i++) {
            block_scales s[WIDE_W_ROWS];
            for (int r = 0; r < R; r++) {
                prefetch_ahead(w_row + r * row_bytes + i * BYTES_PER_BLOCK[f], BYTES_PER_BLOCK[f], PREFETCH_BYTES);
                read_scales(f, w_row + r * row_bytes + i * BYTES_PER_BLOCK[f], &s[r]);
            }
            for (int c = 0; c < chunks_per_block(f); c++) {
                for (int r = 0; r < R; r++) {
                    const __m512 o = _mm512_set1_ps(s[r].offset[c]);
                    chunk_weights(f, w_row + r * row_bytes + i * BYTES_PER_BLOCK[f], c, _mm512_set1_ps(s[r].scale[c]),
                                  _mm512_set1_ps(s[r].scale_hi[c]), o, w[r]);
                }
                multiply_chunk(R, T, w, x + 256 * i + 32 * c, K, acc);
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) result[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#else

/* ---- float kernel: one weight row against `rows` rows of x (float32, row stride K) ---- */

/* Each chunk's integers times x, summed, then times the chunk's scale: fewer multiplies than scaling
   every value, and a row's sums come out the same whatever rows share its tile. */
INLINE void float_tile(const int f, const int rows, const uint8_t *w_row, const float *x, const float *x_sum,
                       int64_t K, float *result) {
    const int64_t chunks_per_row = K / 32;
    __m256 acc[ROW_TILE];
    float offsets[ROW_TILE];
    for (int m = 0; m < rows; m++) {
        acc[m] = _mm256_setzero_ps();
        offsets[m] = 0.0f;
    }
    const int64_t blocks = K / VALUES_PER_BLOCK[f];
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w_row + i * BYTES_PER_BLOCK[f];
        block_scales s;
        prefetch_ahead(b, BYTES_PER_BLOCK[f], PREFETCH_BYTES);
        read_scales(f, b, &s);
        for (int c = 0; c < chunks_per_block(f); c++) {
            __m256 q[4];
            chunk_integers(f, b, c, q);
            const __m256 scale = _mm256_set1_ps(s.scale[c]);
            const int64_t chunk = i * chunks_per_block(f) + c;
            for (int m = 0; m < rows; m++) {
                const float *xc = x + m * K + 32 * chunk;
                if (two_scales(f)) {
                    __m256 low = _mm256_mul_ps(q[0], _mm256_loadu_ps(xc));
                    __m256 high = _mm256_mul_ps(q[2], _mm256_loadu_ps(xc + 16));
                    low = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xc + 8), low);
                    high = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xc + 24), high);
                    acc[m] = _mm256_fmadd_ps(low, scale, acc[m]);
                    acc[m] = _mm256_fmadd_ps(high, _mm256_set1_ps(s.scale_hi[c]), acc[m]);
                } else {
                    __m256 sum = _mm256_mul_ps(q[0], _mm256_loadu_ps(xc));
                    sum = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xc + 8), sum);
                    sum = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xc + 16), sum);
                    sum = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xc + 24), sum);
                    acc[m] = _mm256_fmadd_ps(sum, scale, acc[m]);
                }
                if (has_offset(f)) offsets[m] += s.offset[c] * x_sum[m * chunks_per_row + chunk];
            }
        }
    }
    for (int m = 0; m < rows; m++) result[m] = horizontal_sum(acc[m]) + offsets[m];
}

#endif  /* GB_AVX512 */

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
#if GB_F16C
    return _mm_cvtph_ps(_mm_setr_epi16((short)read_u16(p), (short)read_u16(p + stride), (short)read_u16(p + 2 * stride),
                                       (short)read_u16(p + 3 * stride), 0, 0, 0, 0));
#else
    return _mm_setr_ps(half_to_float(read_u16(p)), half_to_float(read_u16(p + stride)),
                       half_to_float(read_u16(p + 2 * stride)), half_to_float(read_u16(p + 3 * stride)));
#endif
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
static void quantize_row(const float *x, int64_t K, int8_t *q, float *scale, float *sum) {
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

#else  /* portable */

INLINE void float_tile(const int f, const int rows, const uint8_t *w_row, const float *x, const float *x_sum,
                       int64_t K, float *result) {
    (void)x_sum;
    float acc[ROW_TILE] = {0};
    const int64_t blocks = K / VALUES_PER_BLOCK[f];
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w_row + i * BYTES_PER_BLOCK[f];
        block_scales s;
        read_scales(f, b, &s);
        for (int c = 0; c < chunks_per_block(f); c++) {
            int8_t v[32];
            float w[32];
            chunk_values_portable(f, b, c, v);
            for (int l = 0; l < 32; l++) w[l] = (float)v[l] * (l < 16 ? s.scale[c] : s.scale_hi[c]) + s.offset[c];
            const float *xc = x + i * VALUES_PER_BLOCK[f] + 32 * c;
            for (int m = 0; m < rows; m++) {
                float partial = 0.0f;
                for (int l = 0; l < 32; l++) partial += w[l] * xc[m * K + l];
                acc[m] += partial;
            }
        }
    }
    for (int m = 0; m < rows; m++) result[m] = acc[m];
}

INLINE void int8_tile(const int f, const int rows, const uint8_t *w_row, const int8_t *xq, const float *x_scale,
                      const float *x_sum, int64_t K, float *result) {
    const int64_t chunks_per_row = K / 32;
    float acc[ROW_TILE] = {0};
    const int64_t blocks = K / VALUES_PER_BLOCK[f];
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w_row + i * BYTES_PER_BLOCK[f];
        block_scales s;
        read_scales(f, b, &s);
        for (int c = 0; c < chunks_per_block(f); c++) {
            int8_t v[32];
            chunk_values_portable(f, b, c, v);
            const int64_t chunk = i * chunks_per_block(f) + c;
            for (int m = 0; m < rows; m++) {
                const int8_t *xc = xq + m * K + 32 * chunk;
                int32_t low = 0, high = 0;
                for (int l = 0; l < 16; l++) low += v[l] * xc[l];
                for (int l = 16; l < 32; l++) high += v[l] * xc[l];
                const float xs = x_scale[m * chunks_per_row + chunk];
                acc[m] += xs * (s.scale[c] * (float)low + s.scale_hi[c] * (float)high)
                          + s.offset[c] * x_sum[m * chunks_per_row + chunk];
            }
        }
    }
    for (int m = 0; m < rows; m++) result[m] = acc[m];
}

static void quantize_row(const float *x, int64_t K, int8_t *q, float *scale, float *sum) {
    for (int64_t j = 0; j < K / 32; j++) {
        float amax = 0.0f, total = 0.0f;
        for (int l = 0; l < 32; l++) {
            amax = fmaxf(amax, fabsf(x[32 * j + l]));
            total += x[32 * j + l];
        }
        scale[j] = amax / 127.0f;
        sum[j] = total;
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int l = 0; l < 32; l++) q[32 * j + l] = (int8_t)lrintf(x[32 * j + l] * inverse);
    }
}

INLINE void decode_chunk(const int f, const uint8_t *b, const block_scales *s, int c, float *out) {
    int8_t v[32];
    chunk_values_portable(f, b, c, v);
    for (int l = 0; l < 32; l++) out[l] = (float)v[l] * (l < 16 ? s->scale[c] : s->scale_hi[c]) + s->offset[c];
}

#endif

/* each chunk's sum of one row of x, which multiplies the chunk's offset */
static void chunk_sums(const float *x, int64_t K, float *sum) {
    for (int64_t j = 0; j < K / 32; j++) {
        float total = 0.0f;
        for (int l = 0; l < 32; l++) total += x[32 * j + l];
        sum[j] = total;
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

#if GB_AVX512

/* A tile of T rows of x against the weight rows taken beside it (R > 1), or one: each call with
   constant sizes, so that its loops unroll and its sums stay in registers. */
INLINE void weight_rows_tile(const int f, const int T, int64_t R, const uint8_t *w_row, int64_t row_bytes,
                             const float *x, int64_t K, float *result) {
    if (R > 1)
        float_tile(f, weight_rows_beside(T), T, w_row, row_bytes, x, K, result);
    else
        float_tile(f, 1, T, w_row, row_bytes, x, K, result);
}

/* Weight rows first..last-1 against the T rows of x from m0, weight_rows_beside(T) at a time and the
   rows left over one by one. */
INLINE void float_rows_of_tile(const int f, const int T, const product *p, int64_t m0, int64_t first,
                               int64_t last) {
    float result[WIDE_W_ROWS * FLOAT_TILE];
    const float *x = p->x + m0 * p->K;
    for (int64_t n = first, R; n < last; n += R) {
        R = last - n >= weight_rows_beside(T) ? weight_rows_beside(T) : 1;
        weight_rows_tile(f, T, R, p->blocks + n * p->row_bytes, p->row_bytes, x, p->K, result);
        for (int t = 0; t < T; t++)
            for (int r = 0; r < R; r++) write_value(p->out, p->out_dtype, (m0 + t) * p->N + n + r, result[t * R + r]);
    }
}

/* Weight rows first..last-1 against every tile of x rows. The switch picks a whole loop per tile size:
   with the switch inside the loop over weight rows, GCC 12 at -O2 and -O3 (its jump threading and tail
   merging) ran one row of x through the two-row code, reading past x and writing past y. */
INLINE void float_rows(const int f, const product *p, int64_t first, int64_t last) {
    for (int64_t m0 = 0, rows; m0 < p->M; m0 += rows) {
        rows = tile_rows(KERNEL_FLOAT, p->M - m0, p->K);
        switch (rows) {
        case 1: float_rows_of_tile(f, 1, p, m0, first, last); break;
        case 2: float_rows_of_tile(f, 2, p, m0, first, last); break;
        case 4: float_rows_of_tile(f, 4, p, m0, first, last); break;
        default: float_rows_of_tile(f, FLOAT_TILE, p, m0, first, last); break;
        }
    }
}

#endif  /* GB_AVX512 */

/* Weight rows first..last-1, one at a time (the AVX-512 float kernel takes several: float_rows): a
   group of rows that stays in the cache meets every tile of x rows. */
INLINE void rows_of(const int f, const int kernel, const product *p, int64_t first, int64_t last) {
#if GB_AVX512
    if (kernel == KERNEL_FLOAT) {
        float_rows(f, p, first, last);
        return;
    }
#endif
    float result[ROW_TILE];
    for (int64_t m0 = 0, rows; m0 < p->M; m0 += rows) {
        rows = tile_rows(kernel, p->M - m0, p->K);
        const float *x_sum = p->x_sum + m0 * (p->K / 32);
        for (int64_t n = first; n < last; n++) {
            const uint8_t *w_row = p->blocks + n * p->row_bytes;
            if (kernel == KERNEL_FLOAT) {
#if !GB_AVX512
                const float *x = p->x + m0 * p->K;
                switch (rows) {
                case 1: float_tile(f, 1, w_row, x, x_sum, p->K, result); break;
                case 2: float_tile(f, 2, w_row, x, x_sum, p->K, result); break;
                case 4: float_tile(f, 4, w_row, x, x_sum, p->K, result); break;
                default: float_tile(f, FLOAT_TILE, w_row, x, x_sum, p->K, result); break;
                }
#endif
            } else {
                const int8_t *xq = p->xq + m0 * p->K;
                const float *x_scale = p->x_scale + m0 * (p->K / 32);
                switch (rows) {
                case 1: int8_tile(f, 1, w_row, xq, x_scale, x_sum, p->K, result); break;
                case 2: int8_tile(f, 2, w_row, xq, x_scale, x_sum, p->K, result); break;
                case 4: int8_tile(f, 4, w_row, xq, x_scale, x_sum, p->K, result); break;
                default: int8_tile(f, INT8_TILE, w_row, xq, x_scale, x_sum, p->K, result); break;
                }
            }
            for (int m = 0; m < rows; m++) write_value(p->out, p->out_dtype, (m0 + m) * p->N + n, result[m]);
        }
    }
}

/* Row m of x plus the residual (rounded to the dtype, as the sum is written out), divided by its root mean
   square and times the norm's weight (plus offset), into `out` in float32. The steps round as torch's
   elementwise ops do; the mean of squares is summed in double. */
static void normalise_row(const product *p, const void *x, int64_t m, float *out) {
    const pre_norm *n = p->norm;
    const int64_t K = p->K;
    const int dtype = p->in_dtype;
    double squares = 0.0;
    for (int64_t k = 0; k < K; k++) {
        float v = read_value(x, dtype, m * K + k);
        if (n->residual) {
            write_value(n->summed, dtype, m * K + k, v + read_value(n->residual, dtype, m * K + k));
            v = read_value(n->summed, dtype, m * K + k);
        }
        out[k] = v;
        squares += (double)v * v;
    }
    const float scale = 1.0f / sqrtf((float)(squares / (double)K) + n->eps);
    for (int64_t k = 0; k < K; k++) out[k] = (out[k] * scale) * (read_value(n->weight, dtype, k) + n->offset);
}

/* Row m of a gated MLP's [gate | up] values, 2K wide, as silu(gate) * up in float32 into `out`. */
static void gate_row(const product *p, const void *x, int64_t m, float *out) {
    const int64_t K = p->K;
    for (int64_t k = 0; k < K; k++) {
        const float gate = read_value(x, p->in_dtype, m * 2 * K + k);
        out[k] = gate / (1.0f + expf(-gate)) * read_value(x, p->in_dtype, m * 2 * K + K + k);
    }
}

/* Rows m0..m1-1 of x as the kernel reads them: in float32 (normalised first where the product has a
   norm, gated where it is gated), with each chunk's sum, and for the int8 kernel rounded to int8 blocks. */
static void prepare_rows(const product *p, const void *x, int64_t m0, int64_t m1) {
    const int64_t K = p->K;
    for (int64_t m = m0; m < m1; m++) {
        if (p->norm) {
            normalise_row(p, x, m, (float *)p->x + m * K);
        } else if (p->gated) {
            gate_row(p, x, m, (float *)p->x + m * K);
        } else if (p->in_dtype != D_F32) {
            float *converted = (float *)p->x + m * K;
            for (int64_t k = 0; k < K; k++) converted[k] = read_value(x, p->in_dtype, m * K + k);
        }
        if (p->xq)
            quantize_row(p->x + m * K, K, (int8_t *)p->xq + m * K, (float *)p->x_scale + m * (K / 32),
                         (float *)p->x_sum + m * (K / 32));
        else
            chunk_sums(p->x + m * K, K, (float *)p->x_sum + m * (K / 32));
    }
}

typedef void (*rows_function)(const product *, int64_t, int64_t);

#define ROWS_FUNCTIONS(name, f)                                                                          \
    static void float_rows_##name(const product *p, int64_t a, int64_t b) { rows_of(f, KERNEL_FLOAT, p, a, b); } \
    static void int8_rows_##name(const product *p, int64_t a, int64_t b) { rows_of(f, KERNEL_INT8, p, a, b); }

ROWS_FUNCTIONS(q8_0, F_Q8_0)
ROWS_FUNCTIONS(q4_0, F_Q4_0)
ROWS_FUNCTIONS(q4_1, F_Q4_1)
ROWS_FUNCTIONS(q5_0, F_Q5_0)
ROWS_FUNCTIONS(q5_1, F_Q5_1)
ROWS_FUNCTIONS(q4_k, F_Q4_K)
ROWS_FUNCTIONS(q5_k, F_Q5_K)
ROWS_FUNCTIONS(q6_k, F_Q6_K)

static const rows_function FLOAT_ROWS[FORMAT_COUNT] = {
    float_rows_q8_0, float_rows_q4_0, float_rows_q4_1, float_rows_q5_0,
    float_rows_q5_1, float_rows_q4_k, float_rows_q5_k, float_rows_q6_k,
};
static const rows_function INT8_ROWS[FORMAT_COUNT] = {
    int8_rows_q8_0, int8_rows_q4_0, int8_rows_q4_1, int8_rows_q5_0,
    int8_rows_q5_1, int8_rows_q4_k, int8_rows_q5_k, int8_rows_q6_k,
};

/* ---- entry points ---- */

/* Below this many weight values a call runs on the calling thread: a team costs more than it saves.
   One row through Q5_0 on 2 cores (Zen 3), us, 1 thread / 2: 64 x 512 9.1 / 9.8, 128 x 896 14.8 / 13.0. */
#define PARALLEL_FROM_VALUES (1 << 16)

static int check_shape(int format, int64_t N, int64_t K) {
    if (format < 0 || format >= FORMAT_COUNT) return BAD_FORMAT;
    if (N < 0 || K <= 0 || K % VALUES_PER_BLOCK[format]) return BAD_SHAPE;
    return OK;
}

static size_t aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

static int threads_for(int threads, int64_t values) {
    return threads > 1 && values >= PARALLEL_FROM_VALUES ? threads : 1;
}

/* gguf_blocks_matmul's product, of x's rows through `norm` where it is given, or gated where `gated`. */
static int multiply(int format, int kernel, const uint8_t *blocks, int64_t N, int64_t K, const void *x,
                    const pre_norm *norm, int gated, void *y, int64_t M, int dtype, int threads) {
    int status = check_shape(format, N, K);
    if (status != OK) return status;
    if (dtype < D_F32 || dtype > D_F16) return BAD_DTYPE;
    if (kernel != KERNEL_FLOAT && kernel != KERNEL_INT8) return BAD_KERNEL;
    if (M <= 0 || N == 0) return OK;
    product p = {blocks, N, K, K / VALUES_PER_BLOCK[format] * BYTES_PER_BLOCK[format], M, norm, gated,
                 (const float *)x, NULL, NULL, NULL, y, dtype, dtype};
    /* scratch: x in float32 where it comes in another dtype or goes through a norm; each chunk's sum of
       x; for the int8 kernel, x as int8 blocks and their scales */
    const int64_t chunks = M * K / 32;
    const size_t converted = dtype != D_F32 || norm || gated ? aligned(sizeof(float) * (size_t)(M * K)) : 0;
    const size_t sums = aligned(sizeof(float) * (size_t)chunks);
    const size_t quantized = kernel == KERNEL_INT8 ? aligned((size_t)(M * K)) + sums : 0;
    char *scratch = NULL;  /* each part on its own cache lines: loads that split lines are slower */
    if (posix_memalign((void **)&scratch, 64, converted + sums + quantized)) return NO_MEMORY;
    if (converted) p.x = (const float *)scratch;
    p.x_sum = (const float *)(scratch + converted);
    if (quantized) {
        p.x_scale = (const float *)(scratch + converted + sums);
        p.xq = (const int8_t *)(scratch + converted + 2 * sums);
    }
    /* groups of weight rows that stay in the cache while every tile of x meets them, and enough
       groups that threads share the work evenly */
    const int team = threads_for(threads, N * K);
    const int64_t even = (N + 8 * team - 1) / (8 * team);
    int64_t group = GROUP_BYTES / p.row_bytes;
    if (M <= tile_rows(kernel, M, K) || group > even) group = even;
    if (group < 1) group = 1;
#if GB_AVX512
    if (kernel == KERNEL_FLOAT) group = (group + WIDE_W_ROWS - 1) / WIDE_W_ROWS * WIDE_W_ROWS;  /* no rows left over */
#endif
    const int64_t groups = (N + group - 1) / group;
    const rows_function rows = (kernel == KERNEL_FLOAT ? FLOAT_ROWS : INT8_ROWS)[format];

    if (team == 1) {  /* no team to wake for one thread or a small weight */
        prepare_rows(&p, x, 0, M);
        for (int64_t g = 0; g < groups; g++) rows(&p, g * group, g * group + group < N ? g * group + group : N);
    } else {
#pragma omp parallel num_threads(team)
        {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) prepare_rows(&p, x, m, m + 1);
#pragma omp for schedule(dynamic, 1)
            for (int64_t g = 0; g < groups; g++) rows(&p, g * group, g * group + group < N ? g * group + group : N);
        }
    }
    free(scratch);
    return OK;
}

/* y [M, N] = x [M, K] @ W.T for W [N, K] in `format`'s blocks; x and y in `dtype` (D_F32, D_BF16,
   D_F16), both contiguous. kernel: KERNEL_FLOAT or KERNEL_INT8. Returns OK or a negative code. */
int gguf_blocks_matmul(int format, int kernel, const uint8_t *blocks, int64_t N, int64_t K,
                       const void *x, void *y, int64_t M, int dtype, int threads) {
    return multiply(format, kernel, blocks, N, K, x, NULL, 0, y, M, dtype, threads);
}

/* The down projection of a gated MLP: y [M, N] = (silu(gate) * up) @ W.T for x = [gate | up] [M, 2K], the
   gated values kept float32. */
int gguf_blocks_matmul_gated(int format, int kernel, const uint8_t *blocks, int64_t N, int64_t K,
                             const void *x, void *y, int64_t M, int dtype, int threads) {
    return multiply(format, kernel, blocks, N, K, x, NULL, 1, y, M, dtype, threads);
}

/* The same product of x's rows after an RMS norm: with `residual` (else NULL), x + residual first, written
   to `summed`; each row divided by its root mean square (plus eps) and times norm_weight [K] + offset.
   residual, summed and norm_weight in `dtype` too; the normalised rows stay float32. */
int gguf_blocks_matmul_normed(int format, int kernel, const uint8_t *blocks, int64_t N, int64_t K,
                              const void *x, const void *residual, void *summed, const void *norm_weight,
                              float eps, float offset, void *y, int64_t M, int dtype, int threads) {
    const pre_norm norm = {residual, summed, norm_weight, eps, offset};
    return multiply(format, kernel, blocks, N, K, x, &norm, 0, y, M, dtype, threads);
}

INLINE void decode_row(const int f, const uint8_t *row, int64_t K, void *y, int dtype) {
    float values[256];
    for (int64_t i = 0; i < K / VALUES_PER_BLOCK[f]; i++) {
        const uint8_t *b = row + i * BYTES_PER_BLOCK[f];
        block_scales s;
        read_scales(f, b, &s);
        for (int c = 0; c < chunks_per_block(f); c++) decode_chunk(f, b, &s, c, values + 32 * c);
        for (int l = 0; l < VALUES_PER_BLOCK[f]; l++) write_value(y, dtype, i * VALUES_PER_BLOCK[f] + l, values[l]);
    }
}

static void decode_row_of(int format, const uint8_t *row, int64_t K, void *y, int dtype) {
    switch (format) {  /* constant formats, so that each decodes with its own code */
    case F_Q8_0: decode_row(F_Q8_0, row, K, y, dtype); break;
    case F_Q4_0: decode_row(F_Q4_0, row, K, y, dtype); break;
    case F_Q4_1: decode_row(F_Q4_1, row, K, y, dtype); break;
    case F_Q5_0: decode_row(F_Q5_0, row, K, y, dtype); break;
    case F_Q5_1: decode_row(F_Q5_1, row, K, y, dtype); break;
    case F_Q4_K: decode_row(F_Q4_K, row, K, y, dtype); break;
    case F_Q5_K: decode_row(F_Q5_K, row, K, y, dtype); break;
    default: decode_row(F_Q6_K, row, K, y, dtype); break;
    }
}

/* Rows of W decoded into y [count, K] in `dtype`: rows ids[0..count-1], or first..first+count-1 where
   ids is NULL. Returns BAD_ROW (and writes nothing) if a row is outside 0..N-1. */
int gguf_blocks_decode(int format, const uint8_t *blocks, int64_t N, int64_t K, const int64_t *ids,
                       int64_t first, int64_t count, void *y, int dtype, int threads) {
    int status = check_shape(format, N, K);
    if (status != OK) return status;
    if (dtype < D_F32 || dtype > D_F16) return BAD_DTYPE;
    if (ids) {
        for (int64_t r = 0; r < count; r++)
            if (ids[r] < 0 || ids[r] >= N) return BAD_ROW;
    } else if (first < 0 || count < 0 || first + count > N) {
        return BAD_ROW;
    }
    const int64_t row_bytes = K / VALUES_PER_BLOCK[format] * BYTES_PER_BLOCK[format];
    const int64_t element = dtype == D_F32 ? 4 : 2;
    const int team = threads_for(threads, count * K);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t r = 0; r < count; r++)
        decode_row_of(format, blocks + (ids ? ids[r] : first + r) * row_bytes, K, (char *)y + r * K * element, dtype);
    return OK;
}

/* What this build runs on, for logs. */
const char *gguf_blocks_describe(void) {
#ifdef _OPENMP
    return GB_AVX512 ? "avx-512 float, avx2+fma, openmp" : GB_AVX2 ? "avx2+fma, openmp" : "portable C, openmp";
#else
    return GB_AVX512 ? "avx-512 float, avx2+fma, one thread" : GB_AVX2 ? "avx2+fma, one thread"
                                                                   : "portable C, one thread";
#endif
}
