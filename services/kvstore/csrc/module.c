// The store's C functions (block_index.c, block_rows.c) as a Python extension module, `_kvstore`.
//
// Why not ctypes: a control call runs cold (after the transfer it sits between), and cold, one
// ctypes call cost 30-40 µs here and each `array.ctypes.data` another 20-45 µs; a call of this
// module, whose arguments are read in C, costs a few.
//
// Arguments, one letter each in a function's signature:
//   k  a call's keys: a C-contiguous buffer of at least 16 * n bytes
//   r  a call's rows: a C-contiguous buffer of at least 8 * n bytes (int64)
//   n  the count those are checked against
//   p  a pointer: an int address (a column whose address the caller took once), a C-contiguous
//      buffer, or None (NULL)
//   i  int64     u  uint64
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

void block_index_lookup(const uint64_t*, int64_t, const uint64_t*, const int32_t*, uint64_t, int64_t*);
int64_t block_index_insert(const uint64_t*, const int64_t*, int64_t, uint64_t*, int32_t*, uint64_t);
int64_t block_index_add_rows(const uint64_t*, const int64_t*, int64_t, uint64_t*, int32_t*, uint64_t, uint64_t*,
                             int32_t*, int64_t, uint8_t*, int64_t);
int64_t block_index_update(const uint64_t*, const int64_t*, int64_t, const uint64_t*, int32_t*, uint64_t);
int64_t block_index_remove(const uint64_t*, int64_t, uint64_t*, int32_t*, uint64_t);
int64_t block_index_lookup_unique(const uint64_t*, int64_t, const uint64_t*, const int32_t*, uint64_t, int64_t*);
int64_t block_index_prefix(const uint64_t*, int64_t, const uint64_t*, const int32_t*, uint64_t, const uint8_t*,
                           uint8_t*, int64_t*);
void rows_pin(const int64_t*, int64_t, int32_t*, int64_t*, int64_t, const uint8_t*, uint8_t*, int64_t*);
int64_t rows_queue(const int64_t*, int64_t, int64_t*, const uint8_t*, int64_t, int64_t, int64_t*, int64_t*);
int64_t rows_commit_queue(const int64_t*, int64_t, uint8_t*, int32_t*, int64_t*, const uint8_t*, int64_t, int64_t,
                          int64_t*, int64_t*, int64_t*);
int64_t rows_unpin_queue(const int64_t*, int64_t, int32_t*, const uint8_t*, const uint8_t*, const uint8_t*,
                         int64_t*, const uint8_t*, int64_t, int64_t, int64_t*, int64_t*, int64_t*);

#define MAX_ARGS 13

typedef struct {
    uint64_t v[MAX_ARGS];  // each argument as a number (pointers cast)
    Py_buffer view[MAX_ARGS];
    int held[MAX_ARGS];  // view[i] must be released
    int count;
} Args;

static void release(Args* a) {
    for (int i = 0; i < a->count; i++)
        if (a->held[i]) PyBuffer_Release(&a->view[i]);
}

static int convert(const char* name, const char* sig, PyObject* const* args, Py_ssize_t nargs, Args* a) {
    Py_ssize_t want = (Py_ssize_t)strlen(sig);
    int64_t n = -1;
    a->count = 0;
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        PyObject* o = args[i];
        char c = sig[i];
        a->held[i] = 0;
        a->count = (int)i + 1;
        if (c == 'i' || c == 'n') {
            int64_t x = PyLong_AsLongLong(o);
            a->v[i] = (uint64_t)x;
            if (c == 'n') n = x;
        } else if (c == 'u') {
            a->v[i] = PyLong_AsUnsignedLongLong(o);
        } else if (c == 'p' && o == Py_None) {
            a->v[i] = 0;
        } else if (c == 'p' && PyLong_Check(o)) {
            a->v[i] = (uint64_t)(uintptr_t)PyLong_AsVoidPtr(o);
        } else {
            if (PyObject_GetBuffer(o, &a->view[i], PyBUF_C_CONTIGUOUS) < 0) return -1;
            a->held[i] = 1;
            a->v[i] = (uint64_t)(uintptr_t)a->view[i].buf;
        }
        if (PyErr_Occurred()) return -1;
    }
    if (strchr(sig, 'n') && n < 0) {
        PyErr_Format(PyExc_ValueError, "%s: a negative count (%lld)", name, (long long)n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (sig[i] != 'k' && sig[i] != 'r') continue;
        Py_ssize_t need = (Py_ssize_t)n * (sig[i] == 'k' ? 16 : 8);
        if (a->view[i].len < need) {
            PyErr_Format(PyExc_ValueError, "%s: argument %zd holds %zd bytes, %zd needed for %lld", name, i,
                         a->view[i].len, need, (long long)n);
            return -1;
        }
    }
    return 0;
}

#define P(i) ((void*)(uintptr_t)a.v[i])
#define I(i) ((int64_t)a.v[i])
#define U(i) (a.v[i])

// A wrapper: convert the arguments by `sig`, evaluate `expr` (the C call, an int64), release.
#define WRAP(fn, sig, expr)                                                            \
    static PyObject* py_##fn(PyObject* self, PyObject* const* args, Py_ssize_t nargs) { \
        Args a;                                                                        \
        (void)self;                                                                    \
        if (convert(#fn, sig, args, nargs, &a) < 0) {                                  \
            release(&a);                                                               \
            return NULL;                                                               \
        }                                                                              \
        int64_t result = (expr);                                                       \
        release(&a);                                                                   \
        return PyLong_FromLongLong(result);                                            \
    }

WRAP(block_index_lookup, "knppup", (block_index_lookup(P(0), I(1), P(2), P(3), U(4), P(5)), 0))
WRAP(block_index_insert, "krnppu", block_index_insert(P(0), P(1), I(2), P(3), P(4), U(5)))
WRAP(block_index_add_rows, "krnppuppipi",
     block_index_add_rows(P(0), P(1), I(2), P(3), P(4), U(5), P(6), P(7), I(8), P(9), I(10)))
WRAP(block_index_update, "krnppu", block_index_update(P(0), P(1), I(2), P(3), P(4), U(5)))
WRAP(block_index_remove, "knppu", block_index_remove(P(0), I(1), P(2), P(3), U(4)))
WRAP(block_index_lookup_unique, "knppup", block_index_lookup_unique(P(0), I(1), P(2), P(3), U(4), P(5)))
WRAP(block_index_prefix, "knppuppp", block_index_prefix(P(0), I(1), P(2), P(3), U(4), P(5), P(6), P(7)))
WRAP(rows_pin, "rnppippp", (rows_pin(P(0), I(1), P(2), P(3), I(4), P(5), P(6), P(7)), 0))
WRAP(rows_queue, "rnppiipp", rows_queue(P(0), I(1), P(2), P(3), I(4), I(5), P(6), P(7)))
WRAP(rows_commit_queue, "rnppppiippp",
     rows_commit_queue(P(0), I(1), P(2), P(3), P(4), P(5), I(6), I(7), P(8), P(9), P(10)))
WRAP(rows_unpin_queue, "rnppppppiippp",
     rows_unpin_queue(P(0), I(1), P(2), P(3), P(4), P(5), P(6), P(7), I(8), I(9), P(10), P(11), P(12)))

#define METHOD(fn) {#fn, (PyCFunction)(void (*)(void))py_##fn, METH_FASTCALL, NULL}

static PyMethodDef methods[] = {
    METHOD(block_index_lookup), METHOD(block_index_insert), METHOD(block_index_add_rows), METHOD(block_index_update),
    METHOD(block_index_remove), METHOD(block_index_lookup_unique), METHOD(block_index_prefix),
    METHOD(rows_pin), METHOD(rows_queue), METHOD(rows_commit_queue), METHOD(rows_unpin_queue),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_kvstore", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__kvstore(void) { return PyModule_Create(&module); }
