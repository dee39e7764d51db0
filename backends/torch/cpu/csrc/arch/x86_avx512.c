/* The AVX-512 variant: AVX2's int8 kernel (x86_avx2.h), and a float kernel that decodes each chunk's
   weights to float32 once (scale and offset applied) for 4 weight rows at a time (2 beside 8 rows of
   x), so that each load of x feeds that many rows' FMAs: 1.4 to 1.6 times the AVX2 kernel at 16 and 64
   rows of x, level at one. */

#include "x86_avx2.h"

const char arch_name[] = "avx-512 float, avx2+fma";

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
#define ARCH_FLOAT_ROWS 1
#define ARCH_FLOAT_ROW_GROUP WIDE_W_ROWS
#include "../block_rows.h"
