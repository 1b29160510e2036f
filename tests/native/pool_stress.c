/* Stress of the core's worker pool (cn_parallel.h), built with -fsanitize=thread by
 * tests/test_worker_pool.py: five threads each run 2,000 parallel loops of varying thread
 * counts over their own array (so the pool is contended: one caller holds it, the others run
 * serially), and every element must have been processed exactly once per loop. */
#include <stdint.h>
#include <stdio.h>
#include "cn_parallel.h"

#define LOOPS 2000

typedef struct {
    int64_t *out;
    int64_t add;
} job_t;

static void body(void *ctx, int64_t begin, int64_t end) {
    job_t *j = (job_t *)ctx;
    for (int64_t i = begin; i < end; i++) j->out[i] += j->add + i;
}

static void *caller(void *arg) {
    const int64_t id = (int64_t)(intptr_t)arg, n = 5000 + id * 7;
    int64_t *out = (int64_t *)calloc((size_t)n, sizeof(int64_t));
    for (int rep = 0; rep < LOOPS; rep++) {
        job_t j = {out, rep};
        cn_parallel_for(body, &j, n, 1 + (rep % 4));
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t want = LOOPS * i + (int64_t)(LOOPS - 1) * LOOPS / 2;
        if (out[i] != want) {
            printf("caller %ld: item %ld is %ld, expected %ld\n", (long)id, (long)i, (long)out[i], (long)want);
            exit(1);
        }
    }
    free(out);
    return NULL;
}

int main(void) {
    pthread_t threads[4];
    for (int i = 0; i < 4; i++) pthread_create(&threads[i], NULL, caller, (void *)(intptr_t)i);
    caller((void *)(intptr_t)4);
    for (int i = 0; i < 4; i++) pthread_join(threads[i], NULL);
    printf("ok %d workers\n", cn_team.n_workers);
    return 0;
}
