/* Attention of decoding sequences (one query each) over a paged KV cache, on a CPU.

   q [R, Hq, D] float32, the query of each sequence's last token (position seq_len - 1).
   key, value [blocks, block_size, Hk, D], float32, bfloat16 or float16: key j of sequence r is row
   j % block_size of block block_tables[r, j / block_size], j < seq_lens[r].
   out [R, Hq, D] float32. Query head h reads KV head h / (Hq / Hk).

     s_j = scale * (q . k_j);  with a soft cap c > 0: s_j = c * tanh(s_j / c)
     out = sum_j exp(s_j - max s) v_j / sum_j exp(s_j - max s)

   over the keys j the query sees: all of them, or with a window W > 0 the last W. Everything is
   float32, summed in an order the sequence alone fixes: its result does not depend on what else is
   in the batch.

   One task per (sequence, KV head) reads each of its keys and values once for the Hq / Hk query
   heads that share them. Tasks are spread over threads with OpenMP (the process's one runtime,
   torch's, which kernel_library.py loads it beside); without OpenMP, one thread.

   rotary_and_write rotates q and k (rotary embedding) and writes k and v to the cache, for any
   step; rotary_and_decode_attention does that and then attends, for a step of decodes alone. Every
   entry point checks its slots, positions and block tables before it writes or reads anything.
*/

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_abi.h"

#ifdef _OPENMP
#include <omp.h>
#endif


/* The widest vector of floats the target has: 16 (AVX-512), 8 (AVX) or 4 (SSE, NEON). A wider type
   than the target's registers is split by the compiler, and slowly: an AVX2 build of 16 ran at half
   the speed of an SSE one. A dot product's partial sums are added in halves, a few vector adds where
   one float at a time would be a chain. */
#if defined(__AVX512F__)
#define DA_LANES 16
#elif defined(__AVX__)
#define DA_LANES 8
#else
#define DA_LANES 4
#endif
typedef float da_vec __attribute__((vector_size(DA_LANES * sizeof(float))));
typedef float da_vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float da_vec4 __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t da_ivec __attribute__((vector_size(DA_LANES * sizeof(int32_t))));
#if defined(__clang__) || __GNUC__ >= 12
#define DA_SHUFFLE 1
#else
#define DA_SHUFFLE 0
#endif
/* Keys read together: their rows are looked up (and widened) once for every query head. */
#define DA_TILE 32


static float da_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float da_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 to bfloat16 and float16, to nearest with ties to even, as torch converts. */
static uint16_t da_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

static uint16_t da_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00;
    if (magnitude >= 0x477ff000u) return sign | 0x7c00;  /* 65520 and up round to infinity */
    if (magnitude < 0x38800000u) {                       /* below 2^-14: a subnormal, in units of 2^-24 */
        float units;
        memcpy(&units, &magnitude, sizeof units);
        return sign | (uint16_t)nearbyintf(units * 16777216.0f);
    }
    magnitude += 0xfffu + ((magnitude >> 13) & 1);
    return sign | (uint16_t)((magnitude - 0x38000000u) >> 13);
}

static void da_store(void *row, int dtype, int64_t i, float x) {
    if (dtype == D_F32) ((float *)row)[i] = x;
    else ((uint16_t *)row)[i] = dtype == D_BF16 ? da_to_bf16(x) : da_to_f16(x);
}

/* x as stored in dtype and read back. */
static float da_rounded(float x, int dtype) {
    if (dtype == D_F32) return x;
    return dtype == D_BF16 ? da_bf16(da_to_bf16(x)) : da_f16(da_to_f16(x));
}

/* Row `row` (of D values) of a cache, as float32: the cache's own memory where it is float32, else
   widened into `scratch`. */
static const float *da_row(const void *cache, int dtype, int64_t row, int d, float *scratch) {
    if (dtype == D_F32) return (const float *)cache + row * d;
    const uint16_t *half = (const uint16_t *)cache + row * d;
    for (int i = 0; i < d; i++) scratch[i] = dtype == D_BF16 ? da_bf16(half[i]) : da_f16(half[i]);
    return scratch;
}

/* A dot product's partial sums, DA_LANES of them, to 4 (added in halves). */
#if DA_SHUFFLE || DA_LANES == 4
static da_vec4 da_quarter(da_vec sums) {
#if DA_LANES == 16
    da_vec8 eight = __builtin_shufflevector(sums, sums, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(sums, sums, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
#elif DA_LANES == 8
    return __builtin_shufflevector(sums, sums, 0, 1, 2, 3) + __builtin_shufflevector(sums, sums, 4, 5, 6, 7);
#else
    return sums;
#endif
}
#endif

static float da_total(da_vec sums) {
#if DA_SHUFFLE || DA_LANES == 4
    da_vec4 four = da_quarter(sums);
    return (four[0] + four[2]) + (four[1] + four[3]);
#else
    float total = 0;
    for (int l = 0; l < DA_LANES; l++) total += sums[l];
    return total;
#endif
}

/* out[t] = a . rows[t] for t < n: four rows at a time where the compiler can shuffle vectors, their
   partial sums reduced together (a transpose of four vectors of 4), else one at a time. */
static void da_dots(const float *restrict a, const float *const *rows, int n, int d, float *restrict out) {
    int t = 0, whole = d - d % DA_LANES;
#if DA_SHUFFLE
    for (; t + 4 <= n; t += 4) {
        da_vec sums[4] = {{0}}, x, y;
        for (int i = 0; i < whole; i += DA_LANES) {
            memcpy(&x, a + i, sizeof x);
            for (int r = 0; r < 4; r++) {
                memcpy(&y, rows[t + r] + i, sizeof y);
                sums[r] += x * y;
            }
        }
        da_vec4 s0 = da_quarter(sums[0]), s1 = da_quarter(sums[1]), s2 = da_quarter(sums[2]), s3 = da_quarter(sums[3]);
        da_vec4 s01 = __builtin_shufflevector(s0, s1, 0, 1, 4, 5) + __builtin_shufflevector(s0, s1, 2, 3, 6, 7);
        da_vec4 s23 = __builtin_shufflevector(s2, s3, 0, 1, 4, 5) + __builtin_shufflevector(s2, s3, 2, 3, 6, 7);
        da_vec4 four = __builtin_shufflevector(s01, s23, 0, 2, 4, 6) + __builtin_shufflevector(s01, s23, 1, 3, 5, 7);
        for (int r = 0; r < 4; r++) {
            out[t + r] = four[r];
            for (int i = whole; i < d; i++) out[t + r] += a[i] * rows[t + r][i];
        }
    }
#endif
    for (; t < n; t++) {
        da_vec sums = {0}, x, y;
        for (int i = 0; i < whole; i += DA_LANES) {
            memcpy(&x, a + i, sizeof x);
            memcpy(&y, rows[t] + i, sizeof y);
            sums += x * y;
        }
        out[t] = da_total(sums);
        for (int i = whole; i < d; i++) out[t] += a[i] * rows[t][i];
    }
}

static da_vec da_splat(float x) {
    return (da_vec){0} + x;
}

/* Where `take`, a; else b. */
static da_vec da_select(da_ivec take, da_vec a, da_vec b) {
    return (da_vec)((take & (da_ivec)a) | (~take & (da_ivec)b));
}

/* e^x for scores less their largest (x <= 0), lane by lane, within about one unit in the last place:
   x = k ln 2 + r with |r| <= ln(2) / 2, e^r by Cephes' polynomial, 2^k put in the exponent bits. Below
   -87 it gives e^-87 (1.6e-38) rather than the subnormals and zero, nothing beside the largest score's 1. */
static da_vec da_exp(da_vec x) {
    x = da_select(x < -87.0f, da_splat(-87.0f), x);
    da_vec k = x * 1.44269504f + 12582912.0f;  /* 1.5 * 2^23: adding it rounds to a whole number */
    k -= 12582912.0f;
    da_vec r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    da_vec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    da_ivec exponent = (__builtin_convertvector(k, da_ivec) + 127) << 23;
    return p * (da_vec)exponent;
}

/* s[0 : n] in place to exp(s - max s) / sum exp(s - max s). */
static void da_softmax(float *s, int64_t n) {
    da_vec x, tops = da_splat(-INFINITY), sums = {0};
    int64_t whole = n - n % DA_LANES;
    for (int64_t j = 0; j < whole; j += DA_LANES) {
        memcpy(&x, s + j, sizeof x);
        tops = da_select(x > tops, x, tops);
    }
    float top = -INFINITY, total = 0;
    for (int l = 0; l < DA_LANES; l++) top = tops[l] > top ? tops[l] : top;
    for (int64_t j = whole; j < n; j++) top = s[j] > top ? s[j] : top;
    for (int64_t j = 0; j < whole; j += DA_LANES) {
        memcpy(&x, s + j, sizeof x);
        x = da_exp(x - top);
        sums += x;
        memcpy(s + j, &x, sizeof x);
    }
    if (whole < n) {  /* the last few, in a vector padded with the largest score */
        x = da_splat(top);
        memcpy(&x, s + whole, sizeof(float) * (size_t)(n - whole));
        x = da_exp(x - top);
        memcpy(s + whole, &x, sizeof(float) * (size_t)(n - whole));
        for (int64_t j = whole; j < n; j++) total += s[j];
    }
    for (int l = 0; l < DA_LANES; l++) total += sums[l];
    float inverse = 1 / total;
    for (int64_t j = 0; j < n; j++) s[j] *= inverse;
}

/* out += sum over t < n of p[t] * rows[t], d values; the sums of 64 values at a time stay in
   registers across the n rows, added to out once. */
static void da_add_weighted(float *restrict out, const float *restrict p, const float *const *rows, int n, int d) {
    int i = 0;
    for (; i + 4 * DA_LANES <= d; i += 4 * DA_LANES) {
        da_vec sums[4] = {{0}}, x;
        for (int t = 0; t < n; t++)
            for (int c = 0; c < 4; c++) {
                memcpy(&x, rows[t] + i + c * DA_LANES, sizeof x);
                sums[c] += p[t] * x;
            }
        for (int c = 0; c < 4; c++) {
            memcpy(&x, out + i + c * DA_LANES, sizeof x);
            x += sums[c];
            memcpy(out + i + c * DA_LANES, &x, sizeof x);
        }
    }
    for (; i < d; i++) {
        float sum = 0;
        for (int t = 0; t < n; t++) sum += p[t] * rows[t][i];
        out[i] += sum;
    }
}

/* The cache rows of keys [start, start + n) of a sequence in KV head kv_head, as float32 (widened into
   `widened`, n x d, where the cache is not float32). */
static void da_tile_rows(const void *cache, int dtype, const int64_t *table, int block_size, int kv_heads,
                         int kv_head, int d, int64_t start, int n, float *widened, const float **rows) {
    for (int t = 0; t < n; t++) {
        int64_t j = start + t, block = table[j / block_size];
        rows[t] = da_row(cache, dtype, (block * block_size + j % block_size) * kv_heads + kv_head, d,
                         widened + (int64_t)t * d);
    }
}

/* One sequence's `group` query heads (q, group x d) against KV head kv_head, into out (group x d), a
   tile of DA_TILE keys at a time. `scores` holds group x keys floats, `widened` DA_TILE x d. */
static void da_task(const float *q, const void *key, const void *value, int dtype, const int64_t *table,
                    int64_t seq_len, int block_size, int kv_heads, int kv_head, int group, int d, float scale,
                    float softcap, int64_t window, float *scores, float *widened, float *out) {
    int64_t first = window > 0 && seq_len > window ? seq_len - window : 0, keys = seq_len - first;
    const float *rows[DA_TILE];
    for (int64_t start = first; start < seq_len; start += DA_TILE) {
        int n = seq_len - start < DA_TILE ? (int)(seq_len - start) : DA_TILE;
        da_tile_rows(key, dtype, table, block_size, kv_heads, kv_head, d, start, n, widened, rows);
        for (int g = 0; g < group; g++) {
            float *s = scores + g * keys + (start - first);
            da_dots(q + (int64_t)g * d, rows, n, d, s);
            for (int t = 0; t < n; t++) s[t] = softcap > 0 ? softcap * tanhf(scale * s[t] / softcap) : scale * s[t];
        }
    }
    for (int g = 0; g < group; g++) {
        da_softmax(scores + g * keys, keys);
        memset(out + (int64_t)g * d, 0, sizeof(float) * d);
    }
    for (int64_t start = first; start < seq_len; start += DA_TILE) {
        int n = seq_len - start < DA_TILE ? (int)(seq_len - start) : DA_TILE;
        da_tile_rows(value, dtype, table, block_size, kv_heads, kv_head, d, start, n, widened, rows);
        for (int g = 0; g < group; g++)
            da_add_weighted(out + (int64_t)g * d, scores + g * keys + (start - first), rows, n, d);
    }
}

static int da_check(int dtype, int heads, int kv_heads, int d, int block_size) {
    if (dtype != D_F32 && dtype != D_BF16 && dtype != D_F16) return DA_BAD_DTYPE;
    if (kv_heads <= 0 || heads % kv_heads || d <= 0 || block_size <= 0) return DA_BAD_SHAPE;
    return DA_OK;
}

/* Every sequence's length fits its block table, and every block it reads is in the cache. */
static int da_check_tables(const int64_t *block_tables, int64_t table_width, const int64_t *seq_lens,
                           int64_t sequences, int64_t blocks, int block_size) {
    for (int64_t r = 0; r < sequences; r++) {
        if (seq_lens[r] <= 0 || (seq_lens[r] - 1) / block_size >= table_width) return DA_BAD_SHAPE;
        for (int64_t b = 0; b <= (seq_lens[r] - 1) / block_size; b++) {
            int64_t block = block_tables[r * table_width + b];
            if (block < 0 || block >= blocks) return DA_BAD_BLOCK;
        }
    }
    return DA_OK;
}

static int da_attend(const float *q, const void *key, const void *value, int dtype, int block_size,
                     const int64_t *block_tables, int64_t table_width, const int64_t *seq_lens, int64_t sequences,
                     int heads, int kv_heads, int d, float scale, float softcap, int64_t window, float *out,
                     int threads) {
    int group = heads / kv_heads, status = DA_OK;
    int64_t longest = 0, tasks = sequences * kv_heads;
    for (int64_t r = 0; r < sequences; r++) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    if (threads > tasks) threads = (int)tasks;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc(sizeof(float) * ((size_t)group * (size_t)longest + DA_TILE * (size_t)d));
        int mine = scratch ? DA_OK : DA_NO_MEMORY;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (mine != DA_OK) continue;
            int64_t r = t / kv_heads;
            int kv_head = (int)(t % kv_heads);
            int64_t head = (int64_t)kv_head * group;
            da_task(q + (r * heads + head) * d, key, value, dtype, block_tables + r * table_width, seq_lens[r],
                    block_size, kv_heads, kv_head, group, d, scale, softcap, window, scratch,
                    scratch + (size_t)group * (size_t)longest, out + (r * heads + head) * d);
        }
        free(scratch);
        if (mine != DA_OK) {
#pragma omp critical
            status = mine;
        }
    }
    return status;
}

int decode_attention(const float *q, const void *key, const void *value, int dtype, int64_t blocks,
                     int block_size, const int64_t *block_tables, int64_t table_width, const int64_t *seq_lens,
                     int64_t sequences, int heads, int kv_heads, int d, float scale, float softcap,
                     int64_t window, float *out, int threads) {
    int status = da_check(dtype, heads, kv_heads, d, block_size);
    if (status == DA_OK) status = da_check_tables(block_tables, table_width, seq_lens, sequences, blocks, block_size);
    if (status != DA_OK) return status;
    return da_attend(q, key, value, dtype, block_size, block_tables, table_width, seq_lens, sequences, heads,
                     kv_heads, d, scale, softcap, window, out, threads);
}

/* x (d values in dtype) with its first rotary_dim values turned by the angles whose cosines and sines
   are cos_sin[0 : rotary_dim / 2] and cos_sin[rotary_dim / 2 : rotary_dim]: pairs (i, i + rotary_dim / 2)
   ("neox") or (2i, 2i + 1) ("gptj"), each product rounded to float32 before the sum, as torch's
   elementwise ops compute it, so a key rotated here is the key torch's rotary gives. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void da_rotate(const void *x, int dtype, const float *cos_sin, int rotary_dim, int gptj, int d, float *out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    int half = rotary_dim / 2;
    for (int i = 0; i < d; i++) out[i] = dtype == D_F32 ? ((const float *)x)[i]
                                         : dtype == D_BF16 ? da_bf16(((const uint16_t *)x)[i])
                                                            : da_f16(((const uint16_t *)x)[i]);
    for (int i = 0; i < half; i++) {
        int first = gptj ? 2 * i : i, second = gptj ? 2 * i + 1 : i + half;
        float a = out[first], b = out[second], c = cos_sin[i], s = cos_sin[half + i];
        float ac = a * c, bs = b * s, bc = b * c, as = a * s;
        out[first] = ac - bs;
        out[second] = bc + as;
    }
}

/* Token t's q heads rotated into q_out (in dtype, or with q_float in float32 after rounding to dtype),
   and its rotated key and its value written to the cache at slots[t] (none where it is -1). `row`
   holds d floats. */
static void da_rotate_and_write(int64_t t, const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                                const void *v, int64_t v_stride, int dtype, const int64_t *table_rows,
                                const float *cos_sin, int rotary_dim, int gptj, const int64_t *slots, void *key,
                                void *value, int heads, int kv_heads, int d, void *q_out, int q_float, float *row) {
    size_t size = dtype == D_F32 ? sizeof(float) : sizeof(uint16_t);
    const float *angles = cos_sin + table_rows[t] * rotary_dim;
    for (int h = 0; h < heads; h++) {
        da_rotate((const char *)q + (t * q_stride + (int64_t)h * d) * size, dtype, angles, rotary_dim, gptj, d, row);
        int64_t at = (t * heads + h) * d;
        for (int i = 0; i < d; i++) {
            if (q_float) ((float *)q_out)[at + i] = da_rounded(row[i], dtype);
            else da_store(q_out, dtype, at + i, row[i]);
        }
    }
    if (slots[t] < 0) return;
    for (int h = 0; h < kv_heads; h++) {
        int64_t at = (slots[t] * kv_heads + h) * d;
        da_rotate((const char *)k + (t * k_stride + (int64_t)h * d) * size, dtype, angles, rotary_dim, gptj, d, row);
        for (int i = 0; i < d; i++) da_store(key, dtype, at + i, row[i]);
        memcpy((char *)value + at * size, (const char *)v + (t * v_stride + (int64_t)h * d) * size, d * size);
    }
}

static int da_check_rotary(int64_t tokens, const int64_t *table_rows, int64_t table_length, int rotary_dim,
                           int d, const int64_t *slots, int64_t blocks, int block_size) {
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > d) return DA_BAD_SHAPE;
    for (int64_t t = 0; t < tokens; t++) {
        if (table_rows[t] < 0 || table_rows[t] >= table_length) return DA_BAD_POSITION;
        if (slots[t] < -1 || slots[t] >= blocks * block_size) return DA_BAD_SLOT;
    }
    return DA_OK;
}

static int da_rotate_and_write_all(int64_t tokens, const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                                   const void *v, int64_t v_stride, int dtype, const int64_t *table_rows,
                                   const float *cos_sin, int rotary_dim, int gptj, const int64_t *slots, void *key,
                                   void *value, int heads, int kv_heads, int d, void *q_out, int q_float,
                                   int threads) {
    int status = DA_OK;
    if (threads > tokens) threads = (int)tokens;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *row = malloc(sizeof(float) * (size_t)d);
        if (row) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tokens; t++)
                da_rotate_and_write(t, q, q_stride, k, k_stride, v, v_stride, dtype, table_rows, cos_sin, rotary_dim,
                                    gptj, slots, key, value, heads, kv_heads, d, q_out, q_float, row);
        } else {
#pragma omp critical
            status = DA_NO_MEMORY;
        }
        free(row);
    }
    return status;
}

/* Rotary embedding of q and k (token t at row table_rows[t] of cos_sin, [table_length, rotary_dim]
   float32) and the rotated keys and the values written to the cache at their slots: q_out [T, Hq, D]
   in dtype. q, k and v are [T, H, D] in dtype with the given token strides (in values). */
int rotary_and_write(int64_t tokens, const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                     int64_t v_stride, int dtype, const int64_t *table_rows, const float *cos_sin,
                     int64_t table_length, int rotary_dim, int gptj, const int64_t *slots, void *key, void *value,
                     int64_t blocks, int block_size, int heads, int kv_heads, int d, void *q_out, int threads) {
    int status = da_check(dtype, heads, kv_heads, d, block_size);
    if (status == DA_OK) status = da_check_rotary(tokens, table_rows, table_length, rotary_dim, d, slots, blocks, block_size);
    if (status != DA_OK) return status;
    return da_rotate_and_write_all(tokens, q, q_stride, k, k_stride, v, v_stride, dtype, table_rows, cos_sin,
                                   rotary_dim, gptj, slots, key, value, heads, kv_heads, d, q_out, 0, threads);
}

/* rotary_and_write, then decode_attention of the rotated queries, for a step of decodes alone (token r
   is sequence r's one query): one call a layer. */
int rotary_and_decode_attention(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                                int64_t v_stride, int dtype, const int64_t *table_rows, const float *cos_sin,
                                int64_t table_length, int rotary_dim, int gptj, const int64_t *slots, void *key,
                                void *value, int64_t blocks, int block_size, const int64_t *block_tables,
                                int64_t table_width, const int64_t *seq_lens, int64_t sequences, int heads,
                                int kv_heads, int d, float scale, float softcap, int64_t window, float *out,
                                int threads) {
    int status = da_check(dtype, heads, kv_heads, d, block_size);
    if (status == DA_OK)
        status = da_check_rotary(sequences, table_rows, table_length, rotary_dim, d, slots, blocks, block_size);
    if (status == DA_OK) status = da_check_tables(block_tables, table_width, seq_lens, sequences, blocks, block_size);
    if (status != DA_OK) return status;
    float *rotated = malloc(sizeof(float) * (size_t)sequences * (size_t)heads * (size_t)d);
    if (!rotated) return DA_NO_MEMORY;
    status = da_rotate_and_write_all(sequences, q, q_stride, k, k_stride, v, v_stride, dtype, table_rows, cos_sin,
                                     rotary_dim, gptj, slots, key, value, heads, kv_heads, d, rotated, 1, threads);
    if (status == DA_OK)
        status = da_attend(rotated, key, value, dtype, block_size, block_tables, table_width, seq_lens,
                           sequences, heads, kv_heads, d, scale, softcap, window, out, threads);
    free(rotated);
    return status;
}

const char *decode_attention_describe(void) {
#ifdef _OPENMP
    return "float32 decode attention, openmp";
#else
    return "float32 decode attention, one thread";
#endif
}
