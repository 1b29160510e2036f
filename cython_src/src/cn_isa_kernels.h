/* cn_isa_kernels.h: the body of one instruction-set level's translation unit (cn_isa.h).
 *
 * Included once by each src/cn_isa_<level>.c after its `#pragma GCC target`, with CN_ISA_LEVEL
 * set to the level's suffix (base, v3, v4): every inline kernel the headers define is compiled
 * here for that target, and the entry points below, named cn_<kernel>_<level>, fill the
 * level's table cn_kernels_<level>. The entry points only forward to the header's kernels, so
 * every level runs the same source.
 */
#ifndef CN_ISA_LEVEL
#error "define CN_ISA_LEVEL (base, v3 or v4) before including cn_isa_kernels.h"
#endif
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* as Python.h defines it for the extension's own translation unit */
#endif
#include "cn_isa.h"

#define CN_ISA_CAT2(a, b) a##_##b
#define CN_ISA_CAT(a, b) CN_ISA_CAT2(a, b)
#define CN_ISA_FN(name) CN_ISA_CAT(name, CN_ISA_LEVEL)
#define CN_ISA_STR2(x) #x
#define CN_ISA_STR(x) CN_ISA_STR2(x)

static void CN_ISA_FN(cn_table_pool)(const cn_table *t, const int64_t *keys, const int64_t *offsets,
                                     int64_t n_bags, const float *weights, int mode, float *out, int64_t ld_out,
                                     int64_t *argmax, const int64_t *slots) {
    cn_table_pool(t, keys, offsets, n_bags, weights, mode, out, ld_out, argmax, slots);
}

static int CN_ISA_FN(cn_grad_apply)(const cn_arena *a, int64_t dim, int row_dtype, const int64_t *slots,
                                    const int64_t *offsets, int64_t n_bags, const float *weights, int mode,
                                    const int64_t *argmax, const float *grad, int64_t ld_grad, const cn_optim *opt,
                                    int touch_meta, uint32_t step, int nthreads) {
    return cn_grad_apply(a, dim, row_dtype, slots, offsets, n_bags, weights, mode, argmax, grad, ld_grad, opt,
                         touch_meta, step, nthreads);
}

static void CN_ISA_FN(cn_grad_unique)(const cn_groups *g, const int64_t *bag_of, const cn_arena *a, int64_t dim,
                                      const int64_t *slots, const int64_t *offsets, const float *weights, int mode,
                                      const int64_t *argmax, const float *grad, int64_t ld_grad, float *grads_out,
                                      int touch_meta, uint32_t step, int nthreads) {
    cn_grad_unique(g, bag_of, a, dim, slots, offsets, weights, mode, argmax, grad, ld_grad, grads_out, touch_meta,
                   step, nthreads);
}

static void CN_ISA_FN(cn_init_rows_of)(const cn_init *init, const int64_t *keys, int64_t n, float *out, int64_t dim,
                                       int nthreads) {
    cn_init_rows_of(init, keys, n, out, dim, nthreads);
}

static void CN_ISA_FN(cn_init_row)(const cn_init *init, int64_t key, float *restrict row, int64_t dim) {
    cn_init_row(init, key, row, dim);
}

static void CN_ISA_FN(cn_row_load)(int dtype, const void *src, float *restrict dst, int64_t dim) {
    cn_row_load(dtype, src, dst, dim);
}

static void CN_ISA_FN(cn_row_store)(int dtype, const float *restrict src, void *dst, int64_t dim) {
    cn_row_store(dtype, src, dst, dim);
}

const cn_kernels CN_ISA_CAT(cn_kernels, CN_ISA_LEVEL) = {
    CN_ISA_STR(CN_ISA_LEVEL),
    CN_ISA_FN(cn_table_pool),
    CN_ISA_FN(cn_grad_apply),
    CN_ISA_FN(cn_grad_unique),
    CN_ISA_FN(cn_init_rows_of),
    CN_ISA_FN(cn_init_row),
    CN_ISA_FN(cn_row_load),
    CN_ISA_FN(cn_row_store),
};
