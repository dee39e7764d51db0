/* What each ISA file (arch/) gives the block products' entry points. A variant of the library is
   block_products.c with one of them, built with that ISA's compiler flags; the names stay inside it. */

#ifndef CANDELABRA_BLOCK_ARCH_H
#define CANDELABRA_BLOCK_ARCH_H

#include "block_layouts.h"

#define ARCH_PRIVATE __attribute__((visibility("hidden")))

/* weight rows first..last-1 of a product, against every row of x */
typedef void (*rows_function)(const product *, int64_t, int64_t);

/* per format code: the float kernel's and the int8 kernel's rows */
ARCH_PRIVATE extern const rows_function arch_float_rows[FORMAT_COUNT];
ARCH_PRIVATE extern const rows_function arch_int8_rows[FORMAT_COUNT];
/* weight rows the float kernel takes together: a group of rows handed to it is a multiple of this */
ARCH_PRIVATE extern const int arch_float_row_group;
/* what the variant runs, for logs */
ARCH_PRIVATE extern const char arch_name[];

/* one row of x to int8 blocks of 32: q = round(x / scale), scale = max |x| / 127; also each block's sum */
ARCH_PRIVATE void arch_quantize_row(const float *x, int64_t K, int8_t *q, float *scale, float *sum);
/* one weight row of `format` decoded into y [K] in `dtype` */
ARCH_PRIVATE void arch_decode_row(int format, const uint8_t *row, int64_t K, void *y, int dtype);

#endif
