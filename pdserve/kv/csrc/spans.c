// The _kvspans extension module: a transfer's blocks cut into spans, in one pass.
//
// block_runs(local, remote, nbytes[, states, want]) -> [(local, remote, length), ...]
//   local:  a sequence of ints, block i's address in this process's registered memory;
//   remote: a buffer of little-endian uint64, block i's address in the peer's (8 bytes each);
//   nbytes: the block size;
//   states, want: optional, one byte per block; only blocks whose byte equals `want` move.
// Neighbours (of the blocks that move) adjacent on both sides merge into one span, order kept.
// Called once per transfer on the client's hot path: cold, the numpy version of this cost
// 78 µs for 64 blocks and 168 µs for 1,024 (a dozen array operations, each a cold start).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "remote addresses are read as little-endian uint64 in place"
#endif

static int append_span(PyObject *out, uint64_t local, uint64_t remote, uint64_t length) {
    PyObject *span = Py_BuildValue("(KKK)", (unsigned long long)local, (unsigned long long)remote,
                                   (unsigned long long)length);
    if (span == NULL) return -1;
    int rc = PyList_Append(out, span);
    Py_DECREF(span);
    return rc;
}

static int address_of(PyObject *item, uint64_t *out) {
    unsigned long long value;
    if (PyLong_CheckExact(item)) {
        value = PyLong_AsUnsignedLongLong(item);
    } else {
        PyObject *index = PyNumber_Index(item);  // (a numpy integer, say)
        if (index == NULL) return -1;
        value = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
    }
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)value;
    return 0;
}

static PyObject *block_runs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *local;
    Py_buffer remote, states = {0};
    unsigned long long nbytes;
    unsigned char want = 0;
    if (!PyArg_ParseTuple(args, "Oy*K|y*b", &local, &remote, &nbytes, &states, &want)) return NULL;
    PyObject *seq = NULL, *out = NULL;
    seq = PySequence_Fast(local, "block_runs: local addresses must be a sequence of ints");
    if (seq == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (remote.len != n * 8) {
        PyErr_Format(PyExc_ValueError, "block_runs: %zd local addresses for %zd remote ones", n, remote.len / 8);
        goto done;
    }
    if (states.buf != NULL && states.len != n) {
        PyErr_Format(PyExc_ValueError, "block_runs: %zd states for %zd blocks", states.len, n);
        goto done;
    }
    out = PyList_New(0);
    if (out == NULL) goto done;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const unsigned char *rem = remote.buf, *state = states.buf;
    uint64_t start_local = 0, start_remote = 0, run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (state != NULL && state[i] != want) continue;
        uint64_t l, r;
        if (address_of(items[i], &l) < 0) goto fail;
        memcpy(&r, rem + 8 * i, 8);
        if (run && l == start_local + run * nbytes && r == start_remote + run * nbytes) {
            run++;
            continue;
        }
        if (run && append_span(out, start_local, start_remote, run * nbytes) < 0) goto fail;
        start_local = l, start_remote = r, run = 1;
    }
    if (run && append_span(out, start_local, start_remote, run * nbytes) < 0) goto fail;
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&remote);
    if (states.buf != NULL) PyBuffer_Release(&states);
    return out;
}

static PyMethodDef methods[] = {
    {"block_runs", block_runs, METH_VARARGS, "Spans (local, remote, length) of blocks, neighbours merged."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvspans", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvspans(void) { return PyModule_Create(&module); }
