/* Memory read as fast as this CPU can: what bench/native_blocks_speed.py sets a product's read speed
   beside. Each thread sums the 64-bit words of its share of the buffer, asking for the bytes 8 KiB ahead
   as the block kernels do; the sum is returned so that no read can be left out. torch's reductions are
   no such bound here: on a 2-core Intel VM torch.sum read 20 to 22 GB/s, and blocks_int8 read the LM
   head at 28. */

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernel_abi.h"

#define READ_AHEAD_BYTES 8192

static uint64_t sum_words(const uint64_t *words, int64_t count) {
    uint64_t lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __builtin_prefetch((const char *)(words + i) + READ_AHEAD_BYTES, 0, 3);
        for (int l = 0; l < 8; l++) lanes[l] += words[i + l];
    }
    uint64_t total = 0;
    for (; i < count; i++) total += words[i];
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

uint64_t candelabra_read_words(const uint64_t *words, int64_t count, int threads) {
    if (count <= 0) return 0;
    const int team = threads > 1 ? threads : 1;
    uint64_t total = 0;
#pragma omp parallel num_threads(team) reduction(+ : total) if (team > 1)
    {
#ifdef _OPENMP
        const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
#else
        const int64_t parts = 1, part = 0;
#endif
        const int64_t share = (count + parts - 1) / parts, first = part * share;
        const int64_t last = first + share < count ? first + share : count;
        if (first < last) total += sum_words(words + first, last - first);
    }
    return total;
}
