// A call's rows of the block table (services/kvstore/table.py) in one loop: pins, commits and
// eviction-order stamps. Bool columns are one byte per row; rows never repeat within a call.
#include <stdint.h>

// One more pin on each row; a row queued in an eviction order (stamp != 0) leaves it. With
// promote given (a reader's pin), a DRAM row (>= split) that is no tail is marked for promotion.
// out: [left the device order, left the DRAM order, DRAM rows marked].
void rows_pin(const int64_t* rows, int64_t n, int32_t* pins, int64_t* stamp, int64_t split,
              const uint8_t* is_tail, uint8_t* promote, int64_t* out) {
    int64_t left_device = 0, left_dram = 0, marked = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (stamp[r]) {
            stamp[r] = 0;
            if (r < split) left_device++; else left_dram++;
        }
        pins[r]++;
        if (promote && r >= split && !is_tail[r]) { promote[r] = 1; marked++; }
    }
    out[0] = left_device; out[1] = left_dram; out[2] = marked;
}

// One pin less on each row; the rows left with none go to freed, in order. Returns how many,
// or -(i + 1) when row i had no pin (nothing changed from it on). flags: among the freed, how
// many are tails, uncommitted, and marked for promotion (the caller's slow cases).
static int64_t rows_unpin(const int64_t* rows, int64_t n, int32_t* pins, const uint8_t* is_tail,
                          const uint8_t* committed, const uint8_t* promote, int64_t* freed, int64_t* flags) {
    int64_t m = 0;
    flags[0] = flags[1] = flags[2] = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (pins[r] <= 0) return -(i + 1);
        if (--pins[r] == 0) {
            freed[m++] = r;
            flags[0] += is_tail[r];
            flags[1] += !committed[r];
            flags[2] += promote[r];
        }
    }
    return m;
}

// Committed, and the writer's pin let go; the rows left with no pin go to freed, in order.
// Returns how many.
static int64_t rows_commit(const int64_t* rows, int64_t n, uint8_t* committed, int32_t* pins, int64_t* freed) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        committed[r] = 1;
        if (--pins[r] == 0) freed[m++] = r;
    }
    return m;
}

// Queue the rows that are in no eviction order (stamp 0) at the recent end of theirs, in order:
// by group (0: device copies, 1: the device's other blocks, 2: DRAM copies, 3: DRAM's other
// blocks; a copy is a block its writer keeps), each group's rows into out[g * n ...], counts[g]
// of them, stamped first_stamp on, group after group. Returns how many were queued.
int64_t rows_queue(const int64_t* rows, int64_t n, int64_t* stamp, const uint8_t* duplicate, int64_t split,
                   int64_t first_stamp, int64_t* out, int64_t* counts) {
    counts[0] = counts[1] = counts[2] = counts[3] = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (stamp[r]) continue;
        int g = (r >= split) * 2 + (duplicate[r] ? 0 : 1);
        out[g * n + counts[g]++] = r;
    }
    int64_t s = first_stamp;
    for (int g = 0; g < 4; g++)
        for (int64_t k = 0; k < counts[g]; k++) stamp[out[g * n + k]] = s++;
    return s - first_stamp;
}

// rows_commit, then rows_queue of the rows it freed (out: 4 * n places). Returns how many were
// queued.
int64_t rows_commit_queue(const int64_t* rows, int64_t n, uint8_t* committed, int32_t* pins, int64_t* stamp,
                          const uint8_t* duplicate, int64_t split, int64_t first_stamp, int64_t* freed,
                          int64_t* out, int64_t* counts) {
    int64_t m = rows_commit(rows, n, committed, pins, freed);
    return rows_queue(freed, m, stamp, duplicate, split, first_stamp, out, counts);
}

// rows_unpin, then, when none of the rows it freed is a tail, uncommitted or marked for
// promotion (the common release), rows_queue of them (out: 4 * n places; counts[4] = 1).
// Otherwise nothing is queued (counts[4] = 0) and the caller takes the freed rows from there.
// Returns rows_unpin's answer.
int64_t rows_unpin_queue(const int64_t* rows, int64_t n, int32_t* pins, const uint8_t* is_tail,
                         const uint8_t* committed, const uint8_t* promote, int64_t* stamp,
                         const uint8_t* duplicate, int64_t split, int64_t first_stamp, int64_t* freed,
                         int64_t* out, int64_t* counts) {
    int64_t flags[3];
    int64_t m = rows_unpin(rows, n, pins, is_tail, committed, promote, freed, flags);
    counts[4] = 0;
    if (m < 0 || flags[0] || flags[1] || flags[2]) return m;
    rows_queue(freed, m, stamp, duplicate, split, first_stamp, out, counts);
    counts[4] = 1;
    return m;
}
