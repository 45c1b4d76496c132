/* The id maps' hot loops in C: hash-table probes, inserts and rebuilds (hash_table.py holds the layout and
 * the torch version), a training lookup's probe-and-touch and the freeing of rows (remap.py,
 * batched.py), the choice of victims by key and the admission sketches' counts (batched.py),
 * and the gathers, scatters and fills of the rows handed to new ids (row_blocks.py). native.py
 * builds and loads this file; each function makes exactly the decisions of the torch code it
 * replaces.
 *
 * Buckets: keys[H] (raw ids) and slots[H] (>= 0: the key's slot; -1 empty; -2 a tombstone).
 * A key's home is base + (mix64(key) & mask), and it probes base + ((home + k) & mask): several
 * tables laid side by side in one buffer, each a power of two of buckets. Plain loops over the
 * batch, one id at a time: a probe is one or two cache misses, which the torch version pays as
 * a dozen full-batch tensor passes. No allocation, no global state; ctypes releases the GIL.
 */
#include <stdint.h>
#include <string.h>

#define EMPTY (-1)
#define TOMBSTONE (-2)

/* splitmix64's finaliser of x + golden (hash_table.mix64 with salt 0). */
static inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

#define AHEAD 16 /* ids whose home buckets are prefetched ahead of the one probed */

/* The bucket holding id in the table of buckets b..b+m (linear probing from its home; past
 * tombstones and other keys, stopping at an empty bucket), or -1. */
static inline int64_t find_in(const int64_t *keys, const int64_t *slots, int64_t b, int64_t m, int64_t id) {
    int64_t h = (int64_t)(mix64((uint64_t)id) & (uint64_t)m);
    for (int64_t k = 0; k <= m; k++) {  /* at most every bucket once (a table never fills) */
        const int64_t s = slots[b + h];
        if (s == EMPTY)
            return -1;
        if (s >= 0 && keys[b + h] == id)
            return b + h;
        h = (h + 1) & m;
    }
    return -1;
}

/* Ask for id's home bucket in the table of buckets b..b+m (keys and slots) ahead of its probe:
 * a probe is a cache miss, and misses overlap this way. */
static inline void prefetch_home(const int64_t *keys, const int64_t *slots, int64_t b, int64_t m, int64_t id) {
    const int64_t p = b + (int64_t)(mix64((uint64_t)id) & (uint64_t)m);
    __builtin_prefetch(&slots[p]);
    __builtin_prefetch(&keys[p]);
}

/* Bucket of each of ids[n] (-1: absent) into out_pos, and its slot (-1: absent) into out_slot
 * when not NULL. base / mask: per id, or NULL and base0 / mask0 for every id. The buckets of
 * the next AHEAD ids are prefetched: a probe is a cache miss, and misses overlap this way. */
void idhash_probe(const int64_t *keys, const int64_t *slots, const int64_t *ids, int64_t n,
                  const int64_t *base, int64_t base0, const int64_t *mask, int64_t mask0,
                  int64_t *out_pos, int64_t *out_slot) {
    for (int64_t i = -AHEAD; i < n; i++) {
        const int64_t j = i + AHEAD;
        if (j < n)
            prefetch_home(keys, slots, base ? base[j] : base0, mask ? mask[j] : mask0, ids[j]);
        if (i < 0)
            continue;
        const int64_t pos = find_in(keys, slots, base ? base[i] : base0, mask ? mask[i] : mask0, ids[i]);
        out_pos[i] = pos;
        if (out_slot)
            out_slot[i] = pos >= 0 ? slots[pos] : -1;
    }
}

/* Insert new_keys[n] (distinct, absent) with new_slots[n], in order, each into the first empty
 * or tombstone bucket from its home in table tables[i] (NULL: table 0) of `buckets` buckets.
 * out_pos[i]: its bucket; out_reused[i]: 1 where that bucket was a tombstone. Returns the index
 * of the first key that found no bucket (a full table: the caller rebuilds first), or n. */
int64_t idhash_place(int64_t *keys, int64_t *slots, const int64_t *new_keys, const int64_t *tables,
                     const int64_t *new_slots, int64_t n, int64_t buckets, int64_t *out_pos,
                     uint8_t *out_reused) {
    const int64_t m = buckets - 1;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            prefetch_home(keys, slots, tables ? tables[i + AHEAD] * buckets : 0, m, new_keys[i + AHEAD]);
        const int64_t b = tables ? tables[i] * buckets : 0, key = new_keys[i];
        int64_t h = (int64_t)(mix64((uint64_t)key) & (uint64_t)m), k = 0;
        while (slots[b + h] >= 0 && k++ <= m)
            h = (h + 1) & m;
        if (slots[b + h] >= 0)
            return i;
        out_reused[i] = slots[b + h] == TOMBSTONE;
        keys[b + h] = key;
        slots[b + h] = new_slots[i];
        out_pos[i] = b + h;
    }
    return n;
}

/* MapGroup._rebuild: each table tabs[i] of a group (`buckets` buckets each, `rows` rows each)
 * rebuilt from its live keys, re-placed in bucket order into the emptied table (tombstones gone);
 * bucket_of[t * rows + slot] points at each key's new bucket; table_counts[t] = (live, 0).
 * scratch_keys / scratch_slots: `buckets` int64s each. Returns the keys re-placed. */
int64_t idhash_rebuild(int64_t *keys, int64_t *slots, const int64_t *tabs, int64_t m, int64_t buckets, int64_t rows,
                       int64_t *bucket_of, int64_t *table_counts, int64_t *scratch_keys, int64_t *scratch_slots) {
    const int64_t mask = buckets - 1;
    int64_t total = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t t = tabs[i], b = t * buckets;
        int64_t live = 0;
        for (int64_t h = 0; h < buckets; h++) {
            if (slots[b + h] >= 0) {
                scratch_keys[live] = keys[b + h];
                scratch_slots[live++] = slots[b + h];
            }
            keys[b + h] = 0;
            slots[b + h] = EMPTY;
        }
        for (int64_t j = 0; j < live; j++) {  /* idhash_place's rule: the first empty bucket from home */
            int64_t h = (int64_t)(mix64((uint64_t)scratch_keys[j]) & (uint64_t)mask);
            while (slots[b + h] != EMPTY)
                h = (h + 1) & mask;
            keys[b + h] = scratch_keys[j];
            slots[b + h] = scratch_slots[j];
            bucket_of[t * rows + scratch_slots[j]] = b + h;
        }
        table_counts[2 * t] = live;
        table_counts[2 * t + 1] = 0;
        total += live;
    }
    return total;
}

/* -- victims: the lowest keys of each table's movable rows ------------------------------------- */

static void sort_keys(int64_t *a, int64_t n) {  /* insertion sort below 32, else quicksort */
    while (n > 32) {
        int64_t mid = a[n / 2], i = 0, j = n - 1;
        while (i <= j) {
            while (a[i] < mid) i++;
            while (a[j] > mid) j--;
            if (i <= j) { int64_t t = a[i]; a[i++] = a[j]; a[j--] = t; }
        }
        if (j + 1 < n - i) { sort_keys(a, j + 1); a += i; n -= i; }
        else { sort_keys(a + i, n - i); n = j + 1; }
    }
    for (int64_t i = 1; i < n; i++) {
        int64_t v = a[i], j = i - 1;
        while (j >= 0 && a[j] > v) { a[j + 1] = a[j]; j--; }
        a[j + 1] = v;
    }
}

/* Leave the k smallest of a[0..n) in a[0..k), in any order (quickselect; distinct keys). */
static void select_lowest(int64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, rounds = 0;
    while (hi - lo > 32 && rounds++ < 64) {
        int64_t x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];  /* median of three */
        int64_t mid = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < mid) i++;
            while (a[j] > mid) j--;
            if (i <= j) { int64_t t = a[i]; a[i++] = a[j]; a[j--] = t; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
    if (hi > lo) sort_keys(a + lo, hi - lo + 1);  /* small or stubborn: sorted outright */
}

/* For each i < m: of table tabs[i]'s rows (last, used, uses: [*, rows] row-major), those movable
 * (used, last <= top, and uses < below[i] where below is not NULL), by key uses * lfu + last *
 * rows + row ascending (lfu: 0 for least recent first), the first n[i]: their table, row and rank
 * into out_tab / out_row / out_rank. scratch: `rows` int64s. Returns the rows written (at most
 * the sum of n[i]). Keys must not overflow (the caller checks). */
int64_t idhash_victims(const int64_t *last, const uint8_t *used, const int64_t *uses, const int64_t *tabs,
                       const int64_t *n, const int64_t *below, int64_t m, int64_t rows, int64_t top, int64_t lfu,
                       int64_t *scratch, int64_t *out_tab, int64_t *out_row, int64_t *out_rank) {
    int64_t out = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t t = tabs[i], off = t * rows, limit = below ? below[i] : INT64_MAX;
        int64_t c = 0;
        for (int64_t r = 0; r < rows; r++) {  /* branch-free: movability is a coin toss per row */
            scratch[c] = uses[off + r] * lfu + last[off + r] * rows + r;
            c += (used[off + r] != 0) & (last[off + r] <= top) & (uses[off + r] < limit);
        }
        const int64_t k = n[i] < c ? n[i] : c;
        if (k <= 0)
            continue;
        if (k < c)
            select_lowest(scratch, c, k);
        sort_keys(scratch, k);
        for (int64_t j = 0; j < k; j++) {
            out_tab[out] = t;
            out_row[out] = scratch[j] % rows;
            out_rank[out++] = j;
        }
    }
    return out;
}

/* -- the admission sketches' counts (batched.py MapGroup._count) ------------------------------- */

#define SKETCH_AHEAD 8 /* ids whose counters are prefetched ahead of the one counted */

/* Counter of id in row r of its sketch (sketch.sketch_cells_of, without the table's base): double
 * hashing h1 + r * h2 from the halves of mix64(id) with salt 1; equal to the torch version's low
 * bits for any width up to 2^32. */
static inline int64_t sketch_cell(uint64_t h, int64_t r, int64_t width) {
    const uint64_t h1 = h & 0xFFFFFFFFULL, h2 = (h >> 32) | 1;
    return (int64_t)((h1 + (uint64_t)r * h2) & (uint64_t)(width - 1)) + r * width;
}

/* Count-min sketches of M tables side by side (sketch: [M, depth, width] int32, width a power of
 * two): ids[i] (distinct within its table) of table tables[i] adds counts[i] to its depth
 * counters, and added[tables[i]] grows by counts[i]; then out[i] = the smallest of its counters
 * after every add (colliding ids of one batch see each other's counts, as the torch version's
 * scatter_add then gather). */
void idhash_sketch_add(int32_t *sketch, int64_t *added, const int64_t *ids, const int64_t *tables,
                       const int64_t *counts, int64_t n, int64_t width, int64_t depth, int64_t *out) {
    const int64_t per = depth * width;
    for (int64_t i = -SKETCH_AHEAD; i < n; i++) {
        const int64_t j = i + SKETCH_AHEAD;
        if (j < n) {
            const uint64_t h = mix64((uint64_t)ids[j] + 1);
            for (int64_t r = 0; r < depth; r++)
                __builtin_prefetch(sketch + tables[j] * per + sketch_cell(h, r, width), 1);
        }
        if (i < 0)
            continue;
        const uint64_t h = mix64((uint64_t)ids[i] + 1);
        int32_t *base = sketch + tables[i] * per;
        for (int64_t r = 0; r < depth; r++)
            base[sketch_cell(h, r, width)] += (int32_t)counts[i];
        added[tables[i]] += counts[i];
    }
    for (int64_t i = 0; i < n; i++) {  /* estimates once every id has added: a second pass */
        const uint64_t h = mix64((uint64_t)ids[i] + 1);
        const int32_t *base = sketch + tables[i] * per;
        int32_t low = base[sketch_cell(h, 0, width)];
        for (int64_t r = 1; r < depth; r++) {
            const int32_t v = base[sketch_cell(h, r, width)];
            low = v < low ? v : low;
        }
        out[i] = low;
    }
}

/* -- a training lookup's probe: found ids' rows touched on the way ------------------------------ */

/* Row of each of ids[n] in map k[i] (buckets from bucket_base[k], mask bucket_mask[k]; its rows
 * from row_base[k] in last / uses) into out_rows (-1: absent); each found id's row gets last =
 * clock and one more use (repeats counted). The positions of the absent ids go to out_absent, in
 * order; returns their count. */
int64_t idhash_find_touch(const int64_t *keys, const int64_t *slots, const int64_t *ids, const int64_t *k,
                          int64_t n, const int64_t *bucket_base, const int64_t *bucket_mask,
                          const int64_t *row_base, int64_t *last, int64_t *uses, int64_t clock,
                          int64_t *out_rows, int64_t *out_absent) {
    int64_t absent = 0;
    for (int64_t i = -AHEAD; i < n; i++) {
        const int64_t j = i + AHEAD;
        if (j < n)
            prefetch_home(keys, slots, bucket_base[k[j]], bucket_mask[k[j]], ids[j]);
        if (i < 0)
            continue;
        const int64_t pos = find_in(keys, slots, bucket_base[k[i]], bucket_mask[k[i]], ids[i]);
        const int64_t slot = pos >= 0 ? slots[pos] : -1;
        out_rows[i] = slot;
        if (slot >= 0) {
            const int64_t flat = row_base[k[i]] + slot;
            last[flat] = clock;
            uses[flat] += 1;
        } else {
            out_absent[absent++] = i;
        }
    }
    return absent;
}

/* -- freeing rows ------------------------------------------------------------------------------- */

/* MapGroup._release: rows[i] of table tables[i] (by table; a group of tables of `rows` rows, S
 * shared, `buckets` buckets each) lose their ids and go back on their table's free stack in this
 * order. Each id's bucket comes from bucket_of where that still holds it, else is probed.
 * counters: [M, ncol] (column col_free: free rows, col_evicted: evictions); table_counts [M, 2]
 * (live keys, tombstones). Returns n, or the index of the first row whose id is not in its map
 * or that holds no id (the state is then partly updated: the caller raises). */
int64_t idhash_release(const int64_t *keys, int64_t *slots, const int64_t *row_id, const int64_t *bucket_of,
                       uint8_t *used, int64_t *free_stack, int64_t *counters, int64_t ncol, int64_t col_free,
                       int64_t col_evicted, int64_t *table_counts, const int64_t *tables, const int64_t *rows_,
                       int64_t n, int64_t rows, int64_t shared, int64_t buckets) {
    const int64_t m = buckets - 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = tables[i], r = rows_[i], flat = t * rows + r, id = row_id[flat];
        int64_t pos = bucket_of[flat];
        if (!(pos >= t * buckets && pos < (t + 1) * buckets && slots[pos] == r && keys[pos] == id)) {
            pos = find_in(keys, slots, t * buckets, m, id);  /* the cache is stale: probed */
            if (pos < 0)
                return i;
        }
        int64_t *c = counters + t * ncol;
        if (!used[flat] || c[col_free] >= rows - shared)  /* not a held row: refused, never written past */
            return i;
        slots[pos] = TOMBSTONE;
        used[flat] = 0;
        free_stack[t * (rows - shared) + c[col_free]] = r;
        c[col_free] += 1;
        c[col_evicted] += 1;
        table_counts[2 * t] -= 1;
        table_counts[2 * t + 1] += 1;
    }
    return n;
}

/* -- lru / ttl victims from the sorted lists (victims.py) -------------------------------------- */

/* RecentVictims._take: for each i < m, table tabs[i]'s first n[i] true entries of list[head..end)
 * (entry: table << (wb + rb) | last << rb | row; true: the row is used and its last use is still
 * the one listed), as (table, row, rank) into out_*; its head then moves past the last one taken,
 * or to its end when fewer were true. head / end: [M] per table of the group. Where `strict` and
 * some table has fewer than n[i] true entries, returns -1 and changes nothing; else the entries
 * written. new_head: m int64s of scratch. */
int64_t idhash_take(const int64_t *list, int64_t *head, const int64_t *end, const int64_t *tabs, const int64_t *n,
                    int64_t m, const uint8_t *used, const int64_t *last, int64_t rows, int64_t rb, int64_t wb,
                    int64_t strict, int64_t *new_head, int64_t *out_tab, int64_t *out_row, int64_t *out_rank) {
    const int64_t row_mask = ((int64_t)1 << rb) - 1, when_mask = ((int64_t)1 << wb) - 1;
    int64_t out = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t t = tabs[i];
        int64_t p = head[t], got = 0;
        for (; p < end[t] && got < n[i]; p++) {
            const int64_t key = list[p], row = key & row_mask, flat = t * rows + row;
            if (used[flat] && last[flat] == ((key >> rb) & when_mask)) {
                out_tab[out] = t;
                out_row[out] = row;
                out_rank[out++] = got++;
            }
        }
        if (strict && got < n[i])
            return -1;
        new_head[i] = p;  /* past the last one taken (entries skipped on the way are no longer true) */
    }
    for (int64_t i = 0; i < m; i++)
        head[tabs[i]] = new_head[i];
    return out;
}

/* -- rows of a kernel's buffer by index (row_blocks.py: the fresh rows of new ids) -------------- */

#define ROWS_AHEAD 8 /* rows prefetched ahead of the one copied: rows are cache misses, scattered */

/* Where every idx[i] is in [0, n_rows): n, else the index of the first that is not. */
static int64_t rows_check(int64_t n_rows, const int64_t *idx, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= n_rows)
            return i;
    return n;
}

static inline void prefetch_row(const uint8_t *row, int64_t row_bytes, int write) {
    for (int64_t b = 0; b < row_bytes && b < 256; b += 64)
        write ? __builtin_prefetch(row + b, 1) : __builtin_prefetch(row + b, 0);
}

/* Row to_idx[i] of `to` = row from_idx[i] of `from`, for i < n in order (a NULL index: row i of
 * a dense array of n rows); the next rows of both sides prefetched. */
static void rows_move(uint8_t *to, const int64_t *to_idx, const uint8_t *from, const int64_t *from_idx, int64_t n,
                      int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t j = i + ROWS_AHEAD;
        if (j < n) {
            if (from_idx)
                prefetch_row(from + from_idx[j] * row_bytes, row_bytes, 0);
            if (to_idx)
                prefetch_row(to + to_idx[j] * row_bytes, row_bytes, 1);
        }
        memcpy(to + (to_idx ? to_idx[i] : i) * row_bytes, from + (from_idx ? from_idx[i] : i) * row_bytes,
               (size_t)row_bytes);
    }
}

/* out[i] = row idx[i] of buf (n_rows rows of row_bytes bytes), in order (index_select). Returns
 * n, or the index of the first row out of range (nothing copied then). */
int64_t rows_gather(const uint8_t *buf, int64_t n_rows, int64_t row_bytes, const int64_t *idx, int64_t n,
                    uint8_t *out) {
    const int64_t bad = rows_check(n_rows, idx, n);
    if (bad == n)
        rows_move(out, NULL, buf, idx, n, row_bytes);
    return bad;
}

/* Row idx[i] of buf = src[i], in order (index_copy_; idx distinct). Returns as rows_gather. */
int64_t rows_scatter(uint8_t *buf, int64_t n_rows, int64_t row_bytes, const int64_t *idx, int64_t n,
                     const uint8_t *src) {
    const int64_t bad = rows_check(n_rows, idx, n);
    if (bad == n)
        rows_move(buf, idx, src, NULL, n, row_bytes);
    return bad;
}

/* Row dst[i] of buf = row src[i] of buf, in order (dst distinct, no dst among the src): a
 * gather and a scatter without the copy between them. Returns n, or the index of the first pair
 * with a row out of range (nothing copied then). */
int64_t rows_copy(uint8_t *buf, int64_t n_rows, int64_t row_bytes, const int64_t *src, const int64_t *dst, int64_t n) {
    const int64_t bad_src = rows_check(n_rows, src, n), bad_dst = rows_check(n_rows, dst, n);
    const int64_t bad = bad_src < bad_dst ? bad_src : bad_dst;
    if (bad == n)
        rows_move(buf, dst, buf, src, n, row_bytes);
    return bad;
}

/* Every float of row idx[i] of buf (n_rows rows of width floats) = value (index_fill_). Returns
 * as rows_gather. */
int64_t rows_fill_f32(float *buf, int64_t n_rows, int64_t width, const int64_t *idx, int64_t n, float value) {
    const int64_t bad = rows_check(n_rows, idx, n);
    if (bad != n)
        return bad;
    for (int64_t i = 0; i < n; i++) {
        float *row = buf + idx[i] * width;
        for (int64_t j = 0; j < width; j++)
            row[j] = value;
    }
    return n;
}
