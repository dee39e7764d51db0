/* The rows of a block product, one format at a time, and the names an ISA file gives block_products.c
   (block_arch.h). Included last by each file in arch/, after it defines

     int8_tile(f, rows, w_row, xq, x_scale, x_sum, K, result)   one weight row against `rows` rows of int8 x
     decode_chunk(f, b, scales, c, out)                          a chunk's 32 weights in float32
     quantize_row(x, K, q, scale, sum)                           arch_quantize_row's work

   and either float_tile(f, rows, w_row, x, x_sum, K, result), one weight row against `rows` rows of
   float32 x, or (defining ARCH_FLOAT_ROWS) its own float_rows(f, p, first, last) that takes several
   weight rows at a time, and ARCH_FLOAT_ROW_GROUP, how many. */

#include "block_arch.h"

#ifndef ARCH_FLOAT_ROW_GROUP
#define ARCH_FLOAT_ROW_GROUP 1
#endif

/* Weight rows first..last-1 one at a time, against every tile of x rows: a group of rows that stays in
   the cache meets each tile. */
INLINE void rows_of(const int f, const int kernel, const product *p, int64_t first, int64_t last) {
    float result[ROW_TILE];
    for (int64_t m0 = 0, rows; m0 < p->M; m0 += rows) {
        rows = tile_rows(kernel, p->M - m0, p->K);
        const float *x_sum = p->x_sum + m0 * (p->K / 32);
        for (int64_t n = first; n < last; n++) {
            const uint8_t *w_row = p->blocks + n * p->row_bytes;
            if (kernel == KERNEL_INT8) {
                const int8_t *xq = p->xq + m0 * p->K;
                const float *x_scale = p->x_scale + m0 * (p->K / 32);
                switch (rows) {
                case 1: int8_tile(f, 1, w_row, xq, x_scale, x_sum, p->K, result); break;
                case 2: int8_tile(f, 2, w_row, xq, x_scale, x_sum, p->K, result); break;
                case 4: int8_tile(f, 4, w_row, xq, x_scale, x_sum, p->K, result); break;
                default: int8_tile(f, INT8_TILE, w_row, xq, x_scale, x_sum, p->K, result); break;
                }
            } else {
#ifndef ARCH_FLOAT_ROWS
                const float *x = p->x + m0 * p->K;
                switch (rows) {
                case 1: float_tile(f, 1, w_row, x, x_sum, p->K, result); break;
                case 2: float_tile(f, 2, w_row, x, x_sum, p->K, result); break;
                case 4: float_tile(f, 4, w_row, x, x_sum, p->K, result); break;
                default: float_tile(f, FLOAT_TILE, w_row, x, x_sum, p->K, result); break;
                }
#endif
            }
            for (int m = 0; m < rows; m++) write_value(p->out, p->out_dtype, (m0 + m) * p->N + n, result[m]);
        }
    }
}

#ifdef ARCH_FLOAT_ROWS
#define FLOAT_ROWS_OF(f, p, a, b) float_rows(f, p, a, b)
#else
#define FLOAT_ROWS_OF(f, p, a, b) rows_of(f, KERNEL_FLOAT, p, a, b)
#endif

#define ROWS_FUNCTIONS(name, f)                                                                           \
    static void float_rows_##name(const product *p, int64_t a, int64_t b) { FLOAT_ROWS_OF(f, p, a, b); } \
    static void int8_rows_##name(const product *p, int64_t a, int64_t b) { rows_of(f, KERNEL_INT8, p, a, b); }

ROWS_FUNCTIONS(q8_0, F_Q8_0)
ROWS_FUNCTIONS(q4_0, F_Q4_0)
ROWS_FUNCTIONS(q4_1, F_Q4_1)
ROWS_FUNCTIONS(q5_0, F_Q5_0)
ROWS_FUNCTIONS(q5_1, F_Q5_1)
ROWS_FUNCTIONS(q4_k, F_Q4_K)
ROWS_FUNCTIONS(q5_k, F_Q5_K)
ROWS_FUNCTIONS(q6_k, F_Q6_K)

const rows_function arch_float_rows[FORMAT_COUNT] = {
    float_rows_q8_0, float_rows_q4_0, float_rows_q4_1, float_rows_q5_0,
    float_rows_q5_1, float_rows_q4_k, float_rows_q5_k, float_rows_q6_k,
};
const rows_function arch_int8_rows[FORMAT_COUNT] = {
    int8_rows_q8_0, int8_rows_q4_0, int8_rows_q4_1, int8_rows_q5_0,
    int8_rows_q5_1, int8_rows_q4_k, int8_rows_q5_k, int8_rows_q6_k,
};
const int arch_float_row_group = ARCH_FLOAT_ROW_GROUP;

void arch_quantize_row(const float *x, int64_t K, int8_t *q, float *scale, float *sum) {
    quantize_row(x, K, q, scale, sum);
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

void arch_decode_row(int format, const uint8_t *row, int64_t K, void *y, int dtype) {
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
