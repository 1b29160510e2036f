/* cn_isa.h: run-time choice of the instruction set the hot kernels run on.
 *
 * Kernels and levels
 * ------------------
 * The kernels whose speed depends on the instruction set (the pooled forward cn_table_pool, the
 * fused backward + optimizer cn_grad_apply, the per-row gradients cn_grad_unique, the
 * initialiser cn_init_rows_of, cn_init_row, which the insert path calls through
 * cn_init_row_active, cn_init.h, and the 16-bit row conversions cn_row_load / cn_row_store, which
 * the code outside the kernels calls through cn_row_load_active / cn_row_store_active, cn_dtype.h)
 * are compiled three times, each in a translation unit of its own
 * under src/ that starts with `#pragma GCC target("arch=...")` and includes
 * src/cn_isa_kernels.h, which wraps this header's inline code in suffixed entry points:
 *   base  x86-64 (SSE2), what every x86-64 CPU runs              src/cn_isa_base.c
 *   v3    x86-64-v3: AVX2, FMA, F16C, BMI2                       src/cn_isa_v3.c
 *   v4    x86-64-v4: v3 + AVX-512 F/BW/CD/DQ/VL                  src/cn_isa_v4.c
 * Each unit fills a table of function pointers (cn_kernels); the extension calls the kernels
 * through cn_kernels_active (cn_kernel_* below), which module initialisation points at the best
 * level this CPU supports (__builtin_cpu_supports, which also checks that the OS saves the
 * AVX / AVX-512 registers), or at the level CNCORE_ISA names (base | v3 | v4; a value this CPU
 * or this build cannot run is refused, never replaced). Until then (NULL) the kernels are
 * base's, which every CPU runs. The level names are the psABI's microarchitecture levels, as GCC's -march
 * and glibc's hwcaps spell them.
 *
 * The `arch=` pragma replaces the command line's ISA, down as well as up: the base unit of a
 * -march=native build is x86-64 code, so a native build runs every level the CPU has too. The
 * rest of the extension (the find, inserts but their rows' initialiser, eviction, the tier) is
 * compiled once, with the build's flags: x86-64 by default (a source build, CI and a wheel alike),
 * -march=native where CNCORE_NATIVE=1 asks for it (setup.py). Its 16-bit row conversions go
 * through the active level too (cn_row_load_active / cn_row_store_active, cn_dtype.h).
 * Process-wide variables stay in src/cn_globals.c (cn_global.h), so every unit shares one
 * thread pool, one allocation tracer and one stamp counter; no header defines a variable of
 * its own (a `static` variable in a header would give each unit a copy).
 *
 * Other compilers and CPUs: the v3 and v4 units compile to nothing where the target is not
 * x86-64 or the compiler is not GCC (clang spells the pragma differently); base is then the
 * build's own flags and the only level.
 *
 * Numerics
 * --------
 * The levels differ in rounding where a multiply and an add contract into one fused
 * multiply-add (v3 and v4 have FMA; GCC contracts by default): the pooled sums and the
 * optimizer updates differ in the last bits between levels (tests/test_isa_dispatch.py states
 * the bound), and are the same on every thread count within a level. The initialiser is
 * compiled without contraction (cn_init.h), so a key's initial row is the same bits on every
 * level, in every build, and in the insert path.
 *
 * Why: a portable build (x86-64) without these levels loses cn_pool.h's register-held bag sums
 * (AVX-512 only), F16C's conversions and FMA, and its training step against FBGEMM's TBE fell
 * from 0.83-0.89x to 0.69-0.77x (row-wise Adagrad, 8M rows, dims 64 and 16, pooling 20, AMD EPYC
 * Zen 4 guest); with them it runs the native build's kernels (docs/benchmarks.md, "Instruction-set
 * dispatch", has the tables for native, portable and portable with dispatch).
 *
 * Tuning: the `arch=` pragma sets the instructions, not the tuning, so a portable build's kernels
 * are tuned generic and a native build's for its CPU (GCC 12 on the AMD EPYC machine: znver3).
 * The one difference that was measured: generic tuning compiles a memset of a few hundred bytes
 * to `rep stosq`, a microcoded loop, which the pooled forward's register path did once per bag
 * (cn_pool.h zeroes its sums as vector values instead). Before that change, 8M x 64 rows, pooling 1,
 * Zipf 1.05, find + pool with the two builds loaded in one process, calls alternated: portable
 * 1.02-1.04x native's time, and a portable build compiled with -mtune=znver3 1.00x (0.994-0.996);
 * after it, portable 0.98-1.00x native's. Rejected: naming a tuning in the pragmas (tune=znver3
 * in a wheel would tune an Intel CPU's kernels for AMD's; generic is level once no kernel relies
 * on a memset's expansion).
 *
 * Rejected, for structural reasons (not measured):
 *  - GCC's target_clones attribute on the entry points: it clones only the function it marks,
 *    not the static inline kernels reached through cn_parallel_for's function pointers (the
 *    range functions), which are where the time goes.
 *  - An ifunc resolver per entry point: the same clones, a resolver per symbol, and no place to
 *    refuse an override loudly; one table chosen once costs one indirect call per kernel call
 *    (a call moves thousands of rows).
 *  - A level between base and v3 (x86-64-v2: SSE4.2, POPCNT): the kernels use nothing it adds.
 *  - Dispatching the find and the insert too (cn_index.h, cn_table_core.h): their loops are
 *    hashing and dependent loads, and a portable build's find was not measurably slower: 81,920
 *    fresh IDs on 8M rows, medians of seven alternated processes, 3229 us native against 3236
 *    portable (uniform), 1473 against 1500 (Zipf 1.05).
 */
#ifndef CN_ISA_H
#define CN_ISA_H

#include <stdint.h>
#include "cn_global.h"
#include "cn_table.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CN_ISA_X86 1 /* the v3 and v4 units are built */
#else
#define CN_ISA_X86 0
#endif

enum { CN_ISA_BASE = 0, CN_ISA_V3 = 1, CN_ISA_V4 = 2, CN_ISA_LEVELS = 3 };

/* The level's name, as CNCORE_ISA and cncore.kernel_isa() spell it (and its unit's suffix). */
static inline const char *cn_isa_level_name(int level) {
    return level == CN_ISA_V4 ? "v4" : level == CN_ISA_V3 ? "v3" : "base";
}

typedef struct {
    const char *name; /* "base", "v3", "v4" */
    void (*table_pool)(const cn_table *t, const int64_t *keys, const int64_t *offsets, int64_t n_bags,
                       const float *weights, int mode, float *out, int64_t ld_out, int64_t *argmax,
                       const int64_t *slots);
    int (*grad_apply)(const cn_arena *a, int64_t dim, int row_dtype, const int64_t *slots, const int64_t *offsets,
                      int64_t n_bags, const float *weights, int mode, const int64_t *argmax, const float *grad,
                      int64_t ld_grad, const cn_optim *opt, int touch_meta, uint32_t step, int nthreads);
    void (*grad_unique)(const cn_groups *g, const int64_t *bag_of, const cn_arena *a, int64_t dim,
                        const int64_t *slots, const int64_t *offsets, const float *weights, int mode,
                        const int64_t *argmax, const float *grad, int64_t ld_grad, float *grads_out, int touch_meta,
                        uint32_t step, int nthreads);
    void (*init_rows_of)(const cn_init *init, const int64_t *keys, int64_t n, float *out, int64_t dim,
                         int nthreads);
    cn_init_row_fn init_row; /* one row: the insert path's, through cn_init_row_active (cn_init.h) */
    cn_row_load_fn row_load;   /* one 16-bit row widened, outside the kernels (cn_row_load_active, cn_dtype.h) */
    cn_row_store_fn row_store; /* one row rounded to 16 bits, outside the kernels (cn_row_store_active) */
} cn_kernels;

/* One table per compiled level (src/cn_isa_*.c), and the one in use (src/cn_globals.c). */
CN_GLOBAL const cn_kernels cn_kernels_base;
#if CN_ISA_X86
CN_GLOBAL const cn_kernels cn_kernels_v3;
CN_GLOBAL const cn_kernels cn_kernels_v4;
#endif
CN_GLOBAL const cn_kernels *cn_kernels_active; /* NULL: base (C drivers that link cn_globals.c alone) */

/* The kernels of `level`, or NULL when this build has none for it. */
static inline const cn_kernels *cn_isa_kernels_of(int level) {
    if (level == CN_ISA_BASE) return &cn_kernels_base;
#if CN_ISA_X86
    if (level == CN_ISA_V3) return &cn_kernels_v3;
    if (level == CN_ISA_V4) return &cn_kernels_v4;
#endif
    return NULL;
}

/* Whether this CPU (and OS) runs the instructions of `level`. */
static inline int cn_isa_cpu_has(int level) {
    if (level == CN_ISA_BASE) return 1;
#if CN_ISA_X86
    __builtin_cpu_init();
#if __GNUC__ >= 12
    if (level == CN_ISA_V3) return __builtin_cpu_supports("x86-64-v3") != 0;
    if (level == CN_ISA_V4) return __builtin_cpu_supports("x86-64-v4") != 0;
#else /* GCC 11 knows the features, not the level names */
    const int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c") &&
                   __builtin_cpu_supports("movbe") && __builtin_cpu_supports("bmi");
    if (level == CN_ISA_V3) return v3;
    if (level == CN_ISA_V4)
        return v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
#endif
#endif
    return 0;
}

/* Whether `level` can run here: built, and the CPU has it. */
static inline int cn_isa_runnable(int level) {
    return level >= 0 && level < CN_ISA_LEVELS && cn_isa_kernels_of(level) != NULL && cn_isa_cpu_has(level);
}

/* The highest runnable level. */
static inline int cn_isa_best(void) {
    int level = CN_ISA_LEVELS - 1;
    while (level > CN_ISA_BASE && !cn_isa_runnable(level)) level--;
    return level;
}

/* Run the kernels of `level` from now on: 0, or -1 (nothing changed) when it cannot run here.
 * Called once, at module initialisation, before any kernel runs. */
static inline int cn_isa_use(int level) {
    if (!cn_isa_runnable(level)) return -1;
    cn_kernels_active = cn_isa_kernels_of(level);
    cn_init_row_active = cn_kernels_active->init_row;
    cn_row_load_active = cn_kernels_active->row_load;
    cn_row_store_active = cn_kernels_active->row_store;
    return 0;
}

/* The kernels in use. */
static inline const cn_kernels *cn_isa_active(void) {
    const cn_kernels *k = cn_kernels_active;
    return k ? k : &cn_kernels_base;
}

static inline const char *cn_isa_active_name(void) { return cn_isa_active()->name; }

/* The level the including translation unit itself is compiled for (its -march): for the
 * extension's own unit, what the code outside the kernels above runs. */
static inline const char *cn_isa_build_name(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__FMA__)
    return "v4";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return "v3";
#else
    return "base";
#endif
}

/* The kernels, through the active table (same arguments as the functions they are named after). */
static inline void cn_kernel_table_pool(const cn_table *t, const int64_t *keys, const int64_t *offsets,
                                        int64_t n_bags, const float *weights, int mode, float *out, int64_t ld_out,
                                        int64_t *argmax, const int64_t *slots) {
    cn_isa_active()->table_pool(t, keys, offsets, n_bags, weights, mode, out, ld_out, argmax, slots);
}

static inline int cn_kernel_grad_apply(const cn_arena *a, int64_t dim, int row_dtype, const int64_t *slots,
                                       const int64_t *offsets, int64_t n_bags, const float *weights, int mode,
                                       const int64_t *argmax, const float *grad, int64_t ld_grad,
                                       const cn_optim *opt, int touch_meta, uint32_t step, int nthreads) {
    return cn_isa_active()->grad_apply(a, dim, row_dtype, slots, offsets, n_bags, weights, mode, argmax, grad,
                                         ld_grad, opt, touch_meta, step, nthreads);
}

static inline void cn_kernel_grad_unique(const cn_groups *g, const int64_t *bag_of, const cn_arena *a, int64_t dim,
                                         const int64_t *slots, const int64_t *offsets, const float *weights,
                                         int mode, const int64_t *argmax, const float *grad, int64_t ld_grad,
                                         float *grads_out, int touch_meta, uint32_t step, int nthreads) {
    cn_isa_active()->grad_unique(g, bag_of, a, dim, slots, offsets, weights, mode, argmax, grad, ld_grad,
                                   grads_out, touch_meta, step, nthreads);
}

static inline void cn_kernel_init_rows_of(const cn_init *init, const int64_t *keys, int64_t n, float *out,
                                          int64_t dim, int nthreads) {
    cn_isa_active()->init_rows_of(init, keys, n, out, dim, nthreads);
}

#endif
