/* The AVX2 variant (x86_avx2.h), its float kernel one weight row at a time. */

#include "x86_avx2.h"

const char arch_name[] = "avx2+fma";

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
#include "../block_rows.h"
