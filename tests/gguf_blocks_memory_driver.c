/* Every entry point of backends/torch/cpu/csrc/block_products.c over every format, kernel, dtype and a spread
   of row counts, each buffer allocated to its exact size, so that a build with AddressSanitizer stops
   at the first byte read or written outside one. Prints "all ran" at the end. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int gguf_blocks_matmul(int format, int kernel, const uint8_t *blocks, int64_t N, int64_t K, const void *x,
                       void *y, int64_t M, int dtype, int threads);
int gguf_blocks_matmul_gated(int format, int kernel, const uint8_t *blocks, int64_t N, int64_t K, const void *x,
                             void *y, int64_t M, int dtype, int threads);
int gguf_blocks_matmul_normed(int format, int kernel, const uint8_t *blocks, int64_t N, int64_t K, const void *x,
                              const void *residual, void *summed, const void *norm_weight, float eps, float offset,
                              void *y, int64_t M, int dtype, int threads);
int gguf_blocks_decode(int format, const uint8_t *blocks, int64_t N, int64_t K, const int64_t *ids, int64_t first,
                       int64_t count, void *y, int dtype, int threads);

static const int VALUES[8] = {32, 32, 32, 32, 32, 256, 256, 256};
static const int BYTES[8] = {34, 18, 20, 22, 24, 144, 176, 210};

static uint8_t *random_bytes(size_t n) {
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(rand() & 0x3F);  /* small half-precision scales */
    return p;
}

int main(void) {
    const int64_t rows_of_x[] = {1, 2, 3, 4, 5, 8, 9, 17};
    const int64_t weight_rows[] = {1, 3, 4, 7, 13};
    int failures = 0;
    for (int f = 0; f < 8; f++)
        for (int dtype = 0; dtype < 3; dtype++)
            for (size_t a = 0; a < sizeof rows_of_x / sizeof *rows_of_x; a++)
                for (size_t b = 0; b < sizeof weight_rows / sizeof *weight_rows; b++) {
                    const int64_t M = rows_of_x[a], N = weight_rows[b], K = 2 * VALUES[f] + (VALUES[f] == 32 ? 64 : 0);
                    const size_t element = dtype == 0 ? 4 : 2;
                    uint8_t *w = random_bytes((size_t)(N * K / VALUES[f] * BYTES[f]));
                    uint8_t *x = random_bytes((size_t)(M * 2 * K) * element);
                    uint8_t *residual = random_bytes((size_t)(M * K) * element);
                    uint8_t *summed = malloc((size_t)(M * K) * element);
                    uint8_t *norm = random_bytes((size_t)K * element);
                    uint8_t *y = malloc((size_t)(M * N) * element);
                    uint8_t *decoded = malloc((size_t)(N * K) * element);
                    for (int kernel = 0; kernel < 2; kernel++)
                        for (int threads = 1; threads <= 2; threads++) {
                            failures += gguf_blocks_matmul(f, kernel, w, N, K, x, y, M, dtype, threads) != 0;
                            failures += gguf_blocks_matmul_gated(f, kernel, w, N, K, x, y, M, dtype, threads) != 0;
                            failures += gguf_blocks_matmul_normed(f, kernel, w, N, K, x, residual, summed, norm,
                                                                  1e-6f, 1.0f, y, M, dtype, threads) != 0;
                        }
                    failures += gguf_blocks_decode(f, w, N, K, NULL, 0, N, decoded, dtype, 2) != 0;
                    free(w), free(x), free(residual), free(summed), free(norm), free(y), free(decoded);
                }
    if (failures) {
        printf("%d calls answered an error\n", failures);
        return 1;
    }
    printf("all ran\n");
    return 0;
}
