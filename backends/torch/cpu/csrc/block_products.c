/* x @ W.T with W read in its GGUF quantized blocks, as the file stores them (block_layouts.h), on a CPU:
   the entry points, which prepare x and spread the weight's rows over threads; the rows themselves are
   multiplied by the ISA variant this library was built with (arch/, block_arch.h).

   Two kernels, both reading each weight row once per call for all rows of x:

     float  x in float32 (converted once from bfloat16 or float16); each chunk's integers widened
            to float32, multiplied by x and summed with FMAs, then times the chunk's scale, and the
            offset times the chunk's sum of x: exact to float32 rounding.
     int8   each row of x rounded once per call to int8 in blocks of 32 with a float scale, then
            integer dot products of 32 values at a time; the offset term multiplies the exact sum
            of x over the chunk. Error about that of rounding x to 8 bits.

   Rows of the output are spread over threads with OpenMP, which must be the process's one OpenMP
   runtime (torch's): the library leaves its OpenMP symbols for the loader to find in the runtime torch
   has loaded (kernel_library.py). Without OpenMP it runs on one thread.
*/

#include <stdio.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "block_arch.h"

/* each chunk's sum of one row of x, which multiplies the chunk's offset */
static void chunk_sums(const float *x, int64_t K, float *sum) {
    for (int64_t j = 0; j < K / 32; j++) {
        float total = 0.0f;
        for (int l = 0; l < 32; l++) total += x[32 * j + l];
        sum[j] = total;
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
            arch_quantize_row(p->x + m * K, K, (int8_t *)p->xq + m * K, (float *)p->x_scale + m * (K / 32),
                         (float *)p->x_sum + m * (K / 32));
        else
            chunk_sums(p->x + m * K, K, (float *)p->x_sum + m * (K / 32));
    }
}

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
    if (kernel == KERNEL_FLOAT)  /* no rows left over for the float kernel to take one by one */
        group = (group + arch_float_row_group - 1) / arch_float_row_group * arch_float_row_group;
    const int64_t groups = (N + group - 1) / group;
    const rows_function rows = (kernel == KERNEL_FLOAT ? arch_float_rows : arch_int8_rows)[format];

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
        arch_decode_row(format, blocks + (ids ? ids[r] : first + r) * row_bytes, K, (char *)y + r * K * element, dtype);
    return OK;
}

/* What this build runs on, for logs. */
const char *gguf_blocks_describe(void) {
    static char described[96];
#ifdef _OPENMP
    const char *threads = "openmp";
#else
    const char *threads = "one thread";
#endif
    if (!described[0]) snprintf(described, sizeof described, "%s, %s", arch_name, threads);
    return described;
}

/* The digest of the sources this library was built from, which the build passes in. */
const char *candelabra_kernel_sources(void) { return CANDELABRA_SOURCES_DIGEST; }
