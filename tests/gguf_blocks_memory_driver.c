/* Every entry point of backends/torch/cpu/csrc/block_products.c over every format, kernel, dtype and a spread
   of row counts, each buffer allocated to its exact size, so that a build with AddressSanitizer stops
   at the first byte read or written outside one. Prints "all ran" at the end. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernel_abi.h"

static uint8_t *random_bytes(size_t n) {
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(rand() & 0x3F);  /* small half-precision scales */
    return p;
}

int main(void) {
    const int64_t rows_of_x[] = {1, 2, 3, 4, 5, 8, 9, 17};
    const int64_t weight_rows[] = {1, 3, 4, 7, 13};
    int failures = 0;
    for (int f = 0; f < FORMAT_COUNT; f++)
        for (int dtype = D_F32; dtype <= D_F16; dtype++)
            for (size_t a = 0; a < sizeof rows_of_x / sizeof *rows_of_x; a++)
                for (size_t b = 0; b < sizeof weight_rows / sizeof *weight_rows; b++) {
                    const int64_t M = rows_of_x[a], N = weight_rows[b], K = 2 * VALUES_PER_BLOCK[f] + (VALUES_PER_BLOCK[f] == 32 ? 64 : 0);
                    const size_t element = dtype == 0 ? 4 : 2;
                    uint8_t *w = random_bytes((size_t)(N * K / VALUES_PER_BLOCK[f] * BYTES_PER_BLOCK[f]));
                    uint8_t *x = random_bytes((size_t)(M * 2 * K) * element);
                    uint8_t *residual = random_bytes((size_t)(M * K) * element);
                    uint8_t *summed = malloc((size_t)(M * K) * element);
                    uint8_t *norm = random_bytes((size_t)K * element);
                    uint8_t *y = malloc((size_t)(M * N) * element);
                    uint8_t *decoded = malloc((size_t)(N * K) * element);
                    for (int kernel = KERNEL_FLOAT; kernel <= KERNEL_INT8; kernel++)
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
