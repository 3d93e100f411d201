// The store's index of block hashes (services/kvstore/block_index.py): 16-byte keys -> row,
// open addressing with linear probing and backward-shift deletion (no tombstones).
// A table of cap = mask + 1 places: keys [cap][2] u64, rows [cap] i32 (-1: empty). Keys are
// mixed before use, so keys that are not random (tests, crafted input) do not cluster.
#include <stdint.h>
#include <stdlib.h>

static inline uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t x = a ^ (b * 0x9E3779B97F4A7C15ULL);
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27; x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

// out[i] = row of keys[i], or -1.
void block_index_lookup(const uint64_t* keys, int64_t n, const uint64_t* tk, const int32_t* tr,
                        uint64_t mask, int64_t* out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t a = keys[2 * i], b = keys[2 * i + 1];
        uint64_t p = mix(a, b) & mask;
        for (;;) {
            int32_t r = tr[p];
            if (r < 0) { out[i] = -1; break; }
            if (tk[2 * p] == a && tk[2 * p + 1] == b) { out[i] = r; break; }
            p = (p + 1) & mask;
        }
    }
}

// Insert keys[i] -> rows[i]. Returns n, or the index of the first key already present (nothing
// after it inserted; those before it are).
int64_t block_index_insert(const uint64_t* keys, const int64_t* rows, int64_t n, uint64_t* tk,
                           int32_t* tr, uint64_t mask) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t a = keys[2 * i], b = keys[2 * i + 1];
        uint64_t p = mix(a, b) & mask;
        for (;;) {
            int32_t r = tr[p];
            if (r < 0) { tk[2 * p] = a; tk[2 * p + 1] = b; tr[p] = (int32_t)rows[i]; break; }
            if (tk[2 * p] == a && tk[2 * p + 1] == b) return i;
            p = (p + 1) & mask;
        }
    }
    return n;
}

// block_index_insert, and the table's columns (services/kvstore/table.py) set for each row added
// in the same pass: its key, its pins and, when dup, its copy flag. Returns as block_index_insert.
int64_t block_index_add_rows(const uint64_t* keys, const int64_t* rows, int64_t n, uint64_t* tk, int32_t* tr,
                             uint64_t mask, uint64_t* key_col, int32_t* pins, int64_t pin, uint8_t* dup_col,
                             int64_t dup) {
    int64_t done = block_index_insert(keys, rows, n, tk, tr, mask);
    for (int64_t i = 0; i < done; i++) {
        int64_t r = rows[i];
        key_col[2 * r] = keys[2 * i];
        key_col[2 * r + 1] = keys[2 * i + 1];
        pins[r] = (int32_t)pin;
        if (dup) dup_col[r] = 1;
    }
    return done;
}

// Set the row of keys present (moves); returns how many were not present.
int64_t block_index_update(const uint64_t* keys, const int64_t* rows, int64_t n, const uint64_t* tk,
                           int32_t* tr, uint64_t mask) {
    int64_t missing = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t a = keys[2 * i], b = keys[2 * i + 1];
        uint64_t p = mix(a, b) & mask;
        for (;;) {
            int32_t r = tr[p];
            if (r < 0) { missing++; break; }
            if (tk[2 * p] == a && tk[2 * p + 1] == b) { tr[p] = (int32_t)rows[i]; break; }
            p = (p + 1) & mask;
        }
    }
    return missing;
}

// out[i] = row of keys[i], or -1, as block_index_lookup. Returns how many keys are here;
// -(i + 1) when key i repeats an earlier one of keys (out is then partly written); INT64_MIN when
// out of memory. Repeats are found with a table of its own, at least twice n places, made and
// freed here (small, so cache-resident): a put's check and look-up in one pass.
int64_t block_index_lookup_unique(const uint64_t* keys, int64_t n, const uint64_t* tk, const int32_t* tr,
                                  uint64_t mask, int64_t* out) {
    uint64_t places = 16;
    while (places < 2 * (uint64_t)n) places <<= 1;
    uint64_t seen_mask = places - 1;
    uint64_t* sk = malloc(places * 2 * sizeof(uint64_t));
    uint8_t* used = calloc(places, 1);
    int64_t result = 0;
    if (!sk || !used) { result = INT64_MIN; goto done; }
    for (int64_t i = 0; i < n; i++) {
        uint64_t a = keys[2 * i], b = keys[2 * i + 1];
        uint64_t h = mix(a, b);
        uint64_t p = h & seen_mask;
        for (;;) {
            if (!used[p]) { sk[2 * p] = a; sk[2 * p + 1] = b; used[p] = 1; break; }
            if (sk[2 * p] == a && sk[2 * p + 1] == b) { result = -(i + 1); goto done; }
            p = (p + 1) & seen_mask;
        }
        p = h & mask;
        for (;;) {
            int32_t r = tr[p];
            if (r < 0) { out[i] = -1; break; }
            if (tk[2 * p] == a && tk[2 * p + 1] == b) { out[i] = r; result++; break; }
            p = (p + 1) & mask;
        }
    }
done:
    free(sk);
    free(used);
    return result;
}

// Remove keys; returns how many were not present.
int64_t block_index_remove(const uint64_t* keys, int64_t n, uint64_t* tk, int32_t* tr, uint64_t mask) {
    int64_t missing = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t a = keys[2 * i], b = keys[2 * i + 1];
        uint64_t p = mix(a, b) & mask;
        for (;;) {
            if (tr[p] < 0) { missing++; goto next; }
            if (tk[2 * p] == a && tk[2 * p + 1] == b) break;
            p = (p + 1) & mask;
        }
        // Backward shift: pull later entries of the run into the hole when their home allows.
        uint64_t hole = p, q = p;
        for (;;) {
            q = (q + 1) & mask;
            if (tr[q] < 0) break;
            uint64_t home = mix(tk[2 * q], tk[2 * q + 1]) & mask;
            // q may move to hole iff home is not in (hole, q] cyclically.
            int in_between = (hole <= q) ? (home > hole && home <= q) : (home > hole || home <= q);
            if (!in_between) {
                tk[2 * hole] = tk[2 * q]; tk[2 * hole + 1] = tk[2 * q + 1]; tr[hole] = tr[q];
                hole = q;
            }
        }
        tr[hole] = -1; tk[2 * hole] = 0; tk[2 * hole + 1] = 0;
    next:;
    }
    return missing;
}

// The longest prefix of keys whose blocks are here and committed, their rows into out; returns
// its length, or -(i + 1) when key i repeats an earlier one of the prefix. marks: one byte per
// row, all zero, left so.
int64_t block_index_prefix(const uint64_t* keys, int64_t n, const uint64_t* tk, const int32_t* tr,
                           uint64_t mask, const uint8_t* committed, uint8_t* marks, int64_t* out) {
    int64_t m = 0, repeat = -1;
    for (; m < n; m++) {
        uint64_t a = keys[2 * m], b = keys[2 * m + 1];
        uint64_t p = mix(a, b) & mask;
        int32_t r;
        for (;;) {
            r = tr[p];
            if (r < 0 || (tk[2 * p] == a && tk[2 * p + 1] == b)) break;
            p = (p + 1) & mask;
        }
        if (r < 0 || !committed[r]) break;
        if (marks[r]) { repeat = m; break; }
        marks[r] = 1;
        out[m] = r;
    }
    for (int64_t i = 0; i < m; i++) marks[out[i]] = 0;
    return repeat >= 0 ? -(repeat + 1) : m;
}
