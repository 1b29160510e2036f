/* cn_arena.h: the row arena, paged storage for [embedding | optimizer state] rows plus
 * per-row metadata.
 *
 * Rows live in fixed-size pages that are never moved or freed while the table lives, so a slot
 * is a stable address: growth only appends pages (the page table itself may be reallocated,
 * the pages never are). A slot maps to (page = slot >> shift, row = slot & mask).
 *
 * Each row has one cn_meta (access count, last step, and for optimizers with one state value per
 * row, that value), kept apart from the rows, so that a row of dim 64 is exactly four cache lines;
 * the backward touches the metadata line anyway (access counts), so a per-row scalar state costs
 * no extra line there. The metadata lies in chunks of its own (meta_chunks, slot >> meta_shift),
 * each covering one or more whole pages: for a table on huge pages a chunk is 2 MiB, so that it
 * sits on a huge page too. Kept at the end of each page (as it was), a page's metadata was the
 * 2.5 MiB mapping's last 512 KiB (dim 16, row-wise Adagrad), which cn_alloc's madvise cannot
 * cover (a huge page needs an aligned 2 MiB): /proc/self/smaps of an 8M x 16 table showed 245
 * such blocks, 122 MiB, none on huge pages, so the backward's metadata access per distinct row
 * was a TLB miss and a page walk beside the row's own miss. The chunks are sized from the
 * capacity hint (at least a page's rows, at most 2 MiB of metadata), so a small table does not
 * hold a 2 MiB chunk for a few pages' metadata; a table that grows far past its hint keeps its
 * hint's chunk size. Where a chunk would be one page's worth (small pages, and a bounded table's
 * budget page), the metadata stays in the page after its rows and meta_chunks aliases the page
 * table (meta_in_page): a separate block and table would add 128 bytes to a 1-row table's 320.
 *
 * Erased slots go on a free stack of their own (8 bytes per free slot), not on a list threaded
 * through the dead rows' metadata. A threaded list costs no memory, but then a dead row's bytes
 * are structure: a stale or forged slot that reaches the backward (which writes counts and
 * last steps) overwrote the link, and the next insert followed it out of the arena (measured:
 * a crash in 11 of 12 runs of a training thread racing an erasing one). With the stack, no row
 * byte is ever structure, so a slot that passes the cheap range check (cn_arena_slot_ok) can at
 * worst write a dead row. The stack's room is reserved before an erase changes anything, so an
 * erase that cannot allocate leaves the table as it was.
 *
 * A bounded table (one with a row budget, cn_evict.h) also keeps, per page after the metadata,
 * each row's key (8 bytes) and a live bit. Eviction then scans the metadata in slot order, a
 * sequential stream, and knows each victim's key without the index. The alternative, walking
 * the index (16-byte buckets at load <= 0.7) and loading each live bucket's metadata, costs one
 * random miss per row per pass: measured on 1M live rows (a standalone C loop, this layout,
 * prefetch 16 buckets ahead), one pass took 1.8-2.1 ns per row in slot order against 40-48 ns
 * per row in index order, about 20x. The price is 8 bytes + 1 bit per row: +3.0 % on a dim-64
 * row with row-wise Adagrad (280 bytes of row, metadata and key instead of 272). Unbounded
 * tables keep no keys and no bits (key_offset = 0): they pay nothing for it.
 */
#ifndef CN_ARENA_H
#define CN_ARENA_H

#include <stdint.h>
#include <string.h>
#include "cn_alloc.h"

typedef struct {
    uint32_t count;     /* lookups in training mode, saturating at 2^32 - 1 */
    uint32_t last_step; /* the table's step at the last training lookup */
    float scalar_state; /* present only when the arena's meta_bytes is 16 (row-wise optimizers) */
    uint32_t reserved;
} cn_meta;

/* A page's rows fill one 2 MiB huge page (cn_alloc.h), unless the table's capacity hint fits in
 * 64 KiB: then its pages are 64 KiB, so that the many tiny tables of a DLRM do not hold 2 MiB
 * each. A bounded table whose whole budget (max_rows + fallback rows) fits in 64 KiB goes
 * further: one page of the fewest rows, a power of two, that hold the budget (slots map to pages
 * by shift and mask, so a power of two; under 2x its budget, never 64 KiB for 2 rows). Measured
 * (dim 16, row-wise Adagrad, docs/bounded-tables.md, 2026-12-08): a 1-row table allocated
 * 91,136 bytes, 90,240 of them a 1,024-row page, 128 a 16-entry page table and 512 a 64-entry
 * free stack; with the budget page and the small starts below, 320 (64 index, 128 page, 64
 * page table, 64 free stack). Rejected: a page of exactly the budget's rows (no power-of-two
 * slack), which needs a second capacity rule for a one-page arena and a refusal should anything
 * reserve past the budget (Table.reserve can); the slack is at most the budget's own rows. */
#define CN_PAGE_MAX_BYTES ((int64_t)2 << 20)
#define CN_PAGE_MIN_BYTES ((int64_t)64 << 10)

typedef struct {
    char **pages;
    int64_t n_pages;
    int64_t page_table_cap;
    int64_t page_shift; /* rows per page = 1 << page_shift */
    int64_t page_mask;
    int64_t row_floats; /* dim + the optimizer-state floats kept in the row */
    int64_t row_bytes;
    char **meta_chunks;  /* [n_meta_chunks] the cn_meta of 1 << meta_shift slots each, at meta_offset */
    int64_t n_meta_chunks; /* chunks of their own; 0 with meta_in_page (the pages hold them) */
    int64_t meta_offset; /* meta_in_page: the metadata's byte offset in a page, else 0 */
    int meta_in_page;    /* 1: a page holds its rows' metadata, and meta_chunks aliases pages */
    int64_t meta_table_cap;
    int64_t meta_shift; /* >= page_shift: a chunk covers whole pages */
    int64_t meta_mask;
    int64_t meta_bytes;  /* 8 (count, last step) or 16 (plus a scalar optimizer state) */
    int64_t key_offset;  /* bounded tables: byte offset of the page's int64 keys, else 0 */
    int64_t live_offset; /* bounded tables: byte offset of the page's live bits (uint64 words) */
    int64_t page_bytes;
    int64_t high_water; /* slots handed out at least once */
    int64_t *free_slots; /* the free stack: [n_free] slots released by erase, reused first */
    int64_t n_free;
    int64_t free_cap;
} cn_arena;

/* budget_rows: a bounded table's max_rows + fallback rows (the most slots it hands out), or 0. */
static inline void cn_arena_init(cn_arena *a, int64_t row_floats, int with_scalar_state, int64_t capacity_hint,
                                 int track_keys, int64_t budget_rows) {
    memset(a, 0, sizeof(*a));
    a->meta_bytes = with_scalar_state ? 16 : 8;
    a->row_floats = row_floats;
    a->row_bytes = row_floats * (int64_t)sizeof(float);
    int64_t shift = 0;
    /* Cache-line aligned metadata for the usual pages; 16 bytes (a cn_meta never straddles a
     * line) for a budget page, whose few rows live in one or two lines anyway. */
    int64_t meta_align = 64;
    int64_t target = 0; /* the page size aimed at; 0: a budget page */
    /* budget_rows * row_bytes < CN_PAGE_MIN_BYTES, without the product (max_rows may be 2^56). */
    if (budget_rows > 0 && budget_rows < (CN_PAGE_MIN_BYTES + a->row_bytes - 1) / a->row_bytes) {
        while (((int64_t)1 << shift) < budget_rows) shift++;
        meta_align = 16;
    } else {
        /* Either a small page, for a table whose hint fits in one, or a huge page: a table that
         * starts mid-sized may grow large, and then its rows want huge pages (fewer TLB misses). */
        target = capacity_hint * a->row_bytes < CN_PAGE_MIN_BYTES ? CN_PAGE_MIN_BYTES : CN_PAGE_MAX_BYTES;
        while (((int64_t)1 << shift) * a->row_bytes < target) shift++;
    }
    a->page_shift = shift;
    a->page_mask = ((int64_t)1 << shift) - 1;
    /* Metadata chunks: for a table on huge pages up to 2 MiB (see the top). Where a chunk would
     * be one page's worth (small and budget pages), the metadata stays in the page, after its
     * rows, and meta_chunks is the page table itself: no block of its own, no table of its own
     * (a 1-row table would pay 128 bytes more for them, 40 % of its 320). */
    int64_t mshift = shift;
    if (target == CN_PAGE_MAX_BYTES)
        while (((int64_t)1 << (mshift + 1)) * a->meta_bytes <= CN_PAGE_MAX_BYTES &&
               ((int64_t)1 << mshift) < capacity_hint)
            mshift++;
    a->meta_shift = mshift;
    a->meta_mask = ((int64_t)1 << mshift) - 1;
    a->meta_in_page = mshift == shift;
    if (a->meta_in_page) {
        const int64_t rows_part = (((int64_t)1 << shift) * a->row_bytes + meta_align - 1) & ~(meta_align - 1);
        a->meta_offset = rows_part;
        a->page_bytes = rows_part + ((int64_t)1 << shift) * a->meta_bytes;
    } else {
        a->page_bytes = (((int64_t)1 << shift) * a->row_bytes + 63) & ~(int64_t)63;
    }
    if (track_keys) {
        a->page_bytes = (a->page_bytes + 7) & ~(int64_t)7;
        a->key_offset = a->page_bytes;
        a->live_offset = a->key_offset + ((int64_t)1 << shift) * 8;
        a->page_bytes = a->live_offset + ((((int64_t)1 << shift) + 63) / 64) * 8;
    }
}

static inline int64_t cn_arena_rows_per_page(const cn_arena *a) { return (int64_t)1 << a->page_shift; }

static inline int64_t cn_arena_capacity(const cn_arena *a) { return a->n_pages << a->page_shift; }

static inline float *cn_arena_row(const cn_arena *a, int64_t slot) {
    return (float *)(a->pages[slot >> a->page_shift] + (slot & a->page_mask) * a->row_bytes);
}

static inline cn_meta *cn_arena_meta(const cn_arena *a, int64_t slot) {
    return (cn_meta *)(a->meta_chunks[slot >> a->meta_shift] + a->meta_offset + (slot & a->meta_mask) * a->meta_bytes);
}

static inline int64_t cn_arena_meta_chunk_bytes(const cn_arena *a) {
    return ((int64_t)1 << a->meta_shift) * a->meta_bytes;
}

/* Whether page p starts a metadata chunk (its first slot is a chunk's first). */
static inline int cn_arena_page_starts_chunk(const cn_arena *a, int64_t p) {
    return ((p << a->page_shift) & a->meta_mask) == 0;
}

/* Bounded tables: the key of a slot, and the word holding its live bit. */
static inline int64_t *cn_arena_key(const cn_arena *a, int64_t slot) {
    return (int64_t *)(a->pages[slot >> a->page_shift] + a->key_offset) + (slot & a->page_mask);
}

static inline uint64_t *cn_arena_live_word(const cn_arena *a, int64_t slot) {
    return (uint64_t *)(a->pages[slot >> a->page_shift] + a->live_offset) + ((slot & a->page_mask) >> 6);
}

/* Set (1) or clear (0) a slot's live bit; returns the bit it had. */
static inline int cn_arena_set_live(const cn_arena *a, int64_t slot, int live) {
    uint64_t *w = cn_arena_live_word(a, slot);
    const uint64_t bit = (uint64_t)1 << (slot & 63);
    const int was = (*w & bit) != 0;
    *w = live ? (*w | bit) : (*w & ~bit);
    return was;
}

/* Slots that can be handed out without allocating. */
static inline int64_t cn_arena_available(const cn_arena *a) {
    return cn_arena_capacity(a) - a->high_water + a->n_free;
}

/* A slot the arena has handed out (live, or dead and on the free stack): safe to address. */
static inline int cn_arena_slot_ok(const cn_arena *a, int64_t slot) {
    return slot >= 0 && slot < a->high_water;
}

/* Give back the pages beyond the first n_pages (undoing a reserve that failed later on), and
 * the metadata chunks that no page is left in. */
static inline void cn_arena_trim(cn_arena *a, int64_t n_pages, int64_t *nbytes) {
    while (a->n_pages > n_pages && ((a->n_pages - 1) << a->page_shift) >= a->high_water) {
        cn_free(a->pages[--a->n_pages], (size_t)a->page_bytes, nbytes);
        if (!a->meta_in_page && cn_arena_page_starts_chunk(a, a->n_pages) && a->n_meta_chunks > 0)
            cn_free(a->meta_chunks[--a->n_meta_chunks], (size_t)cn_arena_meta_chunk_bytes(a), nbytes);
    }
}

/* Grow a table of block pointers (pages or metadata chunks) to hold one more. */
static inline int cn_arena_grow_table(char ***table, int64_t n, int64_t *cap, int64_t *nbytes) {
    if (n < *cap) return 0;
    const int64_t new_cap = *cap ? *cap * 2 : 8; /* one 64-byte block, cn_alloc's unit */
    char **grown = (char **)cn_alloc((size_t)new_cap * sizeof(char *), nbytes);
    if (grown == NULL) return -1;
    if (n) memcpy(grown, *table, (size_t)n * sizeof(char *));
    cn_free(*table, (size_t)*cap * sizeof(char *), nbytes);
    *table = grown;
    *cap = new_cap;
    return 0;
}

/* Make room for n_more new rows. Returns -1 on allocation failure, with the pages this call
 * added given back, so the arena is exactly as it was. */
static inline int cn_arena_reserve(cn_arena *a, int64_t n_more, int64_t *nbytes) {
    const int64_t n_pages_before = a->n_pages;
    while (cn_arena_available(a) < n_more) {
        const int new_chunk = !a->meta_in_page && cn_arena_page_starts_chunk(a, a->n_pages);
        if (cn_arena_grow_table(&a->pages, a->n_pages, &a->page_table_cap, nbytes) != 0 ||
            (new_chunk && cn_arena_grow_table(&a->meta_chunks, a->n_meta_chunks, &a->meta_table_cap, nbytes) != 0)) {
            cn_arena_trim(a, n_pages_before, nbytes);
            return -1;
        }
        if (a->meta_in_page) a->meta_chunks = a->pages; /* the page table may have moved */
        char *chunk = new_chunk ? (char *)cn_alloc((size_t)cn_arena_meta_chunk_bytes(a), nbytes) : NULL;
        char *page = new_chunk && chunk == NULL ? NULL : (char *)cn_alloc((size_t)a->page_bytes, nbytes);
        if (page == NULL) {
            if (chunk != NULL) cn_free(chunk, (size_t)cn_arena_meta_chunk_bytes(a), nbytes);
            cn_arena_trim(a, n_pages_before, nbytes);
            return -1;
        }
        if (a->key_offset) memset(page + a->live_offset, 0, (size_t)(a->page_bytes - a->live_offset));
        if (new_chunk) a->meta_chunks[a->n_meta_chunks++] = chunk;
        a->pages[a->n_pages++] = page;
    }
    return 0;
}

/* A slot for a new row; the caller has reserved room. */
static inline int64_t cn_arena_take_slot(cn_arena *a) {
    if (a->n_free > 0) return a->free_slots[--a->n_free];
    return a->high_water++;
}

/* Room on the free stack for n_more releases. Returns -1 (stack unchanged) when out of memory. */
static inline int cn_arena_reserve_free(cn_arena *a, int64_t n_more, int64_t *nbytes) {
    if (a->n_free + n_more <= a->free_cap) return 0;
    int64_t cap = a->free_cap ? a->free_cap : 8; /* one 64-byte block: a tiny table's evictions free a slot or two */
    while (cap < a->n_free + n_more) cap *= 2;
    int64_t *stack = (int64_t *)cn_alloc((size_t)cap * sizeof(int64_t), nbytes);
    if (stack == NULL) return -1;
    if (a->n_free) memcpy(stack, a->free_slots, (size_t)a->n_free * sizeof(int64_t));
    cn_free(a->free_slots, (size_t)a->free_cap * sizeof(int64_t), nbytes);
    a->free_slots = stack;
    a->free_cap = cap;
    return 0;
}

/* The caller has reserved room on the free stack (cn_arena_reserve_free). */
static inline void cn_arena_release_slot(cn_arena *a, int64_t slot) { a->free_slots[a->n_free++] = slot; }

/* Forget every row but keep the pages (clear keeps capacity, like std::vector::clear). */
static inline void cn_arena_reset(cn_arena *a) {
    if (a->key_offset)
        for (int64_t p = 0; p < a->n_pages; p++)
            memset(a->pages[p] + a->live_offset, 0, (size_t)(a->page_bytes - a->live_offset));
    a->high_water = 0;
    a->n_free = 0;
}

static inline void cn_arena_free(cn_arena *a, int64_t *nbytes) {
    for (int64_t p = 0; p < a->n_pages; p++) cn_free(a->pages[p], (size_t)a->page_bytes, nbytes);
    cn_free(a->pages, (size_t)a->page_table_cap * sizeof(char *), nbytes);
    if (!a->meta_in_page) {
        for (int64_t c = 0; c < a->n_meta_chunks; c++)
            cn_free(a->meta_chunks[c], (size_t)cn_arena_meta_chunk_bytes(a), nbytes);
        cn_free(a->meta_chunks, (size_t)a->meta_table_cap * sizeof(char *), nbytes);
    }
    a->meta_chunks = NULL;
    a->n_meta_chunks = 0;
    a->meta_table_cap = 0;
    cn_free(a->free_slots, (size_t)a->free_cap * sizeof(int64_t), nbytes);
    a->free_slots = NULL;
    a->free_cap = 0;
    a->pages = NULL;
    a->n_pages = 0;
    a->page_table_cap = 0;
    cn_arena_reset(a);
}

#endif
