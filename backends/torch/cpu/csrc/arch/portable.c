/* The block kernels in plain C, for any CPU: built without vector flags, the compiler vectorises what
   it can for the machine's baseline (SSE2 on x86-64, NEON on aarch64). */

#include "../block_layouts.h"

const char arch_name[] = "portable C";

INLINE void decode_chunk(const int f, const uint8_t *b, const block_scales *s, int c, float *out) {
    int8_t v[32];
    chunk_values_portable(f, b, c, v);
    for (int l = 0; l < 32; l++) out[l] = (float)v[l] * (l < 16 ? s->scale[c] : s->scale_hi[c]) + s->offset[c];
}
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
            float w[32];
            decode_chunk(f, b, &s, c, w);
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

INLINE void quantize_row(const float *x, int64_t K, int8_t *q, float *scale, float *sum) {
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

#include "../block_rows.h"
