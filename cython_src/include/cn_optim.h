/* cn_optim.h: per-row optimizer updates, applied in place to [embedding | state] rows.
 *
 * Semantics follow the references the tests compare against:
 *   SGD                    w -= lr * g                                      (torch.optim.SGD)
 *   ADAGRAD                s += g*g;  w -= lr * g / (sqrt(s) + eps)          (torch.optim.Adagrad)
 *   ROWWISE_ADAGRAD        s += mean(g*g);  w -= lr / (sqrt(s) + eps) * g    (FBGEMM EXACT_ROWWISE_ADAGRAD)
 *   ADAM                   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g*g;
 *                          w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)  (torch.optim.Adam)
 * Updates are lazy: only rows that received a gradient move (as torch's sparse optimizers and
 * FBGEMM's fused tables do); t is the table's step, shared by all rows.
 */
#ifndef CN_OPTIM_H
#define CN_OPTIM_H

#include <math.h>
#include <stdint.h>

enum { CN_OPT_NONE = 0, CN_OPT_SGD = 1, CN_OPT_ADAGRAD = 2, CN_OPT_ROWWISE_ADAGRAD = 3, CN_OPT_ADAM = 4 };

typedef struct {
    int kind;
    float lr;
    float eps;
    float beta1, beta2;
    float bias1, bias2_sqrt; /* 1 - beta1^t and sqrt(1 - beta2^t), set per step */
} cn_optim;

static inline int64_t cn_optim_state_floats(int kind, int64_t dim) {
    switch (kind) {
    case CN_OPT_ADAGRAD: return dim;
    case CN_OPT_ROWWISE_ADAGRAD: return 1;
    case CN_OPT_ADAM: return 2 * dim;
    default: return 0;
    }
}

static inline void cn_optim_set_step(cn_optim *o, int64_t step) {
    o->bias1 = (float)(1.0 - pow((double)o->beta1, (double)step));
    o->bias2_sqrt = (float)sqrt(1.0 - pow((double)o->beta2, (double)step));
}

/* Row-wise Adagrad keeps its one float in the row's metadata (cn_arena.h); the others keep
 * their state right after the embedding. */
static inline int cn_optim_state_in_meta(int kind) { return kind == CN_OPT_ROWWISE_ADAGRAD; }

/* Apply gradient g to row w (dim floats) with optimizer state st (cn_optim_state_floats). */
static inline void cn_optim_apply(const cn_optim *o, float *restrict w, float *restrict st, const float *restrict g,
                                  int64_t dim) {
    float lr = o->lr;
    switch (o->kind) {
    case CN_OPT_SGD:
        for (int64_t d = 0; d < dim; d++) w[d] -= lr * g[d];
        break;
    case CN_OPT_ADAGRAD: {
        float *restrict s = st;
        for (int64_t d = 0; d < dim; d++) {
            s[d] += g[d] * g[d];
            w[d] -= lr * g[d] / (sqrtf(s[d]) + o->eps);
        }
        break;
    }
    case CN_OPT_ROWWISE_ADAGRAD: {
        /* Eight partial sums in a fixed order: vectorises without -ffast-math and gives the
         * same bits on every thread count. */
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t d8 = dim & ~(int64_t)7;
        for (int64_t d = 0; d < d8; d += 8)
            for (int k = 0; k < 8; k++) part[k] += g[d + k] * g[d + k];
        float sq = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
        for (int64_t d = d8; d < dim; d++) sq += g[d] * g[d];
        float s = st[0] + sq / (float)dim;
        st[0] = s;
        float step = lr / (sqrtf(s) + o->eps);
        for (int64_t d = 0; d < dim; d++) w[d] -= step * g[d];
        break;
    }
    case CN_OPT_ADAM: {
        float *restrict m = st;
        float *restrict v = st + dim;
        float b1 = o->beta1, b2 = o->beta2;
        float step = lr / o->bias1;
        float inv_b2 = 1.0f / o->bias2_sqrt;
        for (int64_t d = 0; d < dim; d++) {
            m[d] = b1 * m[d] + (1.0f - b1) * g[d];
            v[d] = b2 * v[d] + (1.0f - b2) * g[d] * g[d];
            w[d] -= step * m[d] / (sqrtf(v[d]) * inv_b2 + o->eps);
        }
        break;
    }
    default:
        break;
    }
}

#endif
