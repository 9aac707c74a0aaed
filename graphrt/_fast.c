/* graphrt._fast: Step.validate's checks and Step.pack's writes in one C pass each.

   The same rules as graphrt/step.py (which stays the reference and the fallback, and
   writes every error message): check() answers only "valid or not", and on "not" the
   caller runs the Python checks, which raise naming the sequence. Inputs are the Step's
   int64 numpy arrays (any strides); outputs are the staging views (int32 / int64, any
   strides). Every index is bounded by the arrays' own shapes.

   copy_h2d() is the step's one host-to-device copy and the event after it, as two calls
   into the CUDA driver that the process has already loaded (torch's runtime loads it);
   torch's copy_ + Event.record does the same through its dispatcher in ~3x the time. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>
#include <dlfcn.h>

typedef struct {
    Py_buffer b;
    int held;
} Buf;

static int get(PyObject *obj, Buf *out, int ndim, int itemsize, int writable, const char *name) {
    out->held = 0;
    if (PyObject_GetBuffer(obj, &out->b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    out->held = 1;
    char f = out->b.format ? out->b.format[0] : 'B';
    if (f == '<' || f == '=' || f == '@') f = out->b.format[1];
    int is_int = f == 'i' || f == 'l' || f == 'q';
    if (out->b.ndim != ndim || out->b.itemsize != itemsize || !is_int) {
        PyErr_Format(PyExc_TypeError, "graphrt._fast: %s must be a %d-d int%d array", name, ndim, 8 * itemsize);
        return -1;
    }
    return 0;
}

static void release(Buf *bufs, int n) {
    for (int i = 0; i < n; i++)
        if (bufs[i].held) PyBuffer_Release(&bufs[i].b);
}

#define AT1(B, i) ((char *)(B).b.buf + (Py_ssize_t)(i) * (B).b.strides[0])
#define AT2(B, i, j) (AT1(B, i) + (Py_ssize_t)(j) * (B).b.strides[1])
#define AT3(B, i, j, k) (AT2(B, i, j) + (Py_ssize_t)(k) * (B).b.strides[2])
#define I64(p) (*(int64_t *)(p))

/* 1 when an id of ids[0:count] is >= nb (unsigned). Independent compares OR-ed together,
   which the compiler vectorizes (an AVX2 clone where the CPU has it), not a running
   maximum, whose select chain cost about a cycle per id. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static uint64_t ids_outside(const uint64_t *ids, int64_t count, uint64_t nb) {
    uint64_t bad = 0;
    for (int64_t j = 0; j < count; j++) bad |= ids[j] >= nb;
    return bad;
}

/* check(q, c, table, counts|None, ranges, rcounts|None, block_size, max_num_tokens,
         max_model_len, max_blocks_per_seq, num_blocks, max_prefix_ranges)
   -> the block-table columns the step uses, or None if any rule is broken. */
static PyObject *check(PyObject *self, PyObject *args) {
    PyObject *oq, *oc, *ot, *ocounts, *or, *orc;
    long long bs, max_tokens, max_len, max_bps, num_blocks, max_ranges;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLLLL", &oq, &oc, &ot, &ocounts, &or, &orc, &bs, &max_tokens, &max_len,
                          &max_bps, &num_blocks, &max_ranges))
        return NULL;
    Buf B[6];
    memset(B, 0, sizeof B);
    PyObject *result = NULL;
    int64_t *seen = NULL;
    if (get(oq, &B[0], 1, 8, 0, "q_lens") || get(oc, &B[1], 1, 8, 0, "context_lens") ||
        get(ot, &B[2], 2, 8, 0, "block_table") || get(or, &B[3], 3, 8, 0, "ranges") ||
        (ocounts != Py_None && get(ocounts, &B[4], 1, 8, 0, "block_counts")) ||
        (orc != Py_None && get(orc, &B[5], 1, 8, 0, "range_counts")))
        goto done;
    Py_ssize_t n = B[0].b.shape[0], width = B[2].b.shape[1], R = B[3].b.shape[1];
    if (B[1].b.shape[0] != n || B[2].b.shape[0] != n || B[3].b.shape[0] != n || B[3].b.shape[2] != 2 ||
        (B[4].held && B[4].b.shape[0] != n) || (B[5].held && B[5].b.shape[0] != n) || bs < 1) {
        PyErr_SetString(PyExc_ValueError, "graphrt._fast.check: arrays of different lengths");
        goto done;
    }
    long long limit = max_bps < width ? max_bps : width, total = 0, columns = 0, written = 0;
    int ok = n >= 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        int64_t q = I64(AT1(B[0], i)), c = I64(AT1(B[1], i));
        if (q < 1 || c < 0 || q > max_len || c > max_len) { ok = 0; break; }
        int64_t sl = q + c;
        total += q;
        if (sl > max_len || total > max_tokens) { ok = 0; break; }
        int64_t count = B[4].held ? I64(AT1(B[4], i)) : (sl + bs - 1) / bs;
        if (count > limit || count * bs < sl) { ok = 0; break; }     /* count <= width: no overflow */
        if (count > columns) columns = count;
        /* every id in [0, num_blocks): as unsigned, a negative id is huge */
        const uint64_t nb = (uint64_t)num_blocks;
        uint64_t bad = 0;
        const char *row = AT1(B[2], i);
        Py_ssize_t step = B[2].b.strides[1];
        if (step == 8) {
            bad = ids_outside((const uint64_t *)row, count, nb);
        } else {
            for (int64_t j = 0; j < count; j++) bad |= *(const uint64_t *)(row + j * step) >= nb;
        }
        if (bad) { ok = 0; break; }
        written += (sl - 1) / bs - c / bs + 1;
        /* prefix ranges: the first k of the row, previous end (0 first) <= start < end <= seq_len */
        int64_t k;
        if (B[5].held) {
            k = I64(AT1(B[5], i));
        } else {
            k = 0;
            for (Py_ssize_t r = 0; r < R; r++)
                k += I64(AT3(B[3], i, r, 1)) > I64(AT3(B[3], i, r, 0));
        }
        if (k > max_ranges) { ok = 0; break; }
        if (k > R) k = R;
        int64_t prev = 0;
        for (int64_t r = 0; r < k; r++) {
            int64_t s = I64(AT3(B[3], i, r, 0)), e = I64(AT3(B[3], i, r, 1));
            if (!(prev <= s && s < e && e <= sl)) { ok = 0; break; }
            prev = e;
        }
    }
    if (ok) {
        /* the blocks the new tokens write must be distinct: an open-addressing set */
        Py_ssize_t cap = 16;
        while (cap < 2 * written) cap <<= 1;
        seen = (int64_t *)malloc(sizeof(int64_t) * (size_t)cap);
        if (!seen) { PyErr_NoMemory(); goto done; }
        memset(seen, 0xff, sizeof(int64_t) * (size_t)cap);              /* -1: empty */
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            int64_t c = I64(AT1(B[1], i)), sl = c + I64(AT1(B[0], i));
            for (int64_t j = c / bs; ok && j <= (sl - 1) / bs; j++) {
                int64_t blk = I64(AT2(B[2], i, j));
                Py_ssize_t h = (Py_ssize_t)(((uint64_t)blk * 0x9E3779B97F4A7C15ULL) >> 20) & (cap - 1);
                while (seen[h] != -1 && seen[h] != blk) h = (h + 1) & (cap - 1);
                if (seen[h] == blk) ok = 0;
                seen[h] = blk;
            }
        }
    }
    if (ok) result = PyLong_FromLongLong(columns);
    else { Py_INCREF(Py_None); result = Py_None; }
done:
    free(seen);
    release(B, 6);
    return result;
}

/* pack(q, c, table, ranges, block_size, block_columns, query_start_loc, seq_lens,
        block_table, prefix_ranges, slot_mapping, positions|None): write a validated step
   into a bucket's staging views, padding as Step.pack documents. */
static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *oq, *oc, *ot, *or, *oqsl, *osl, *obt, *opr, *oslots, *opos;
    long long bs, w;
    if (!PyArg_ParseTuple(args, "OOOOLLOOOOOO", &oq, &oc, &ot, &or, &bs, &w, &oqsl, &osl, &obt, &opr, &oslots, &opos))
        return NULL;
    Buf B[10];
    memset(B, 0, sizeof B);
    PyObject *result = NULL;
    if (get(oq, &B[0], 1, 8, 0, "q_lens") || get(oc, &B[1], 1, 8, 0, "context_lens") ||
        get(ot, &B[2], 2, 8, 0, "block_table") || get(or, &B[3], 3, 8, 0, "ranges") ||
        get(oqsl, &B[4], 1, 4, 1, "query_start_loc") || get(osl, &B[5], 1, 4, 1, "seq_lens") ||
        get(obt, &B[6], 2, 4, 1, "block_table view") || get(opr, &B[7], 3, 4, 1, "prefix_ranges") ||
        get(oslots, &B[8], 1, 8, 1, "slot_mapping") || (opos != Py_None && get(opos, &B[9], 1, 8, 1, "positions")))
        goto done;
    Py_ssize_t n = B[0].b.shape[0], R = B[3].b.shape[1], S = B[5].b.shape[0], RS = B[7].b.shape[1];
    Py_ssize_t T = B[8].b.shape[0];
    /* pack trusts check() for the values' limits, but never reads or writes out of bounds:
       negative lengths and keys past the table's width are refused here too */
    int64_t total = 0, bad = B[1].b.shape[0] != n;
    for (Py_ssize_t i = 0; !bad && i < n; i++) {
        int64_t q = I64(AT1(B[0], i)), c = I64(AT1(B[1], i));
        bad = q < 0 || c < 0 || q > T || c > INT32_MAX || (c + q + bs - 1) / bs > B[2].b.shape[1];
        total += q;
    }
    if (bad || B[2].b.shape[0] != n || B[3].b.shape[0] != n || n > S ||
        B[4].b.shape[0] != S + 1 || B[6].b.shape[0] != S || w > B[6].b.shape[1] || w > B[2].b.shape[1] ||
        B[7].b.shape[0] != S || B[7].b.shape[2] != 2 || total > T || (B[9].held && B[9].b.shape[0] != T) || bs < 1) {
        PyErr_SetString(PyExc_ValueError, "graphrt._fast.pack: the step does not fit the staging views");
        goto done;
    }
    int64_t at = 0;
    const int ranges_packed = B[7].b.strides[2] == 4 && B[7].b.strides[1] == 8;
    *(int32_t *)AT1(B[4], 0) = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t q = I64(AT1(B[0], i)), c = I64(AT1(B[1], i)), sl = q + c;
        *(int32_t *)AT1(B[5], i) = (int32_t)sl;
        if (R == 0 && ranges_packed) {        /* no ranges in the step: a row of zeros */
            memset(AT3(B[7], i, 0, 0), 0, (size_t)RS * 8);
        } else {
            for (Py_ssize_t r = 0; r < RS; r++) {
                int64_t s = r < R ? I64(AT3(B[3], i, r, 0)) : 0, e = r < R ? I64(AT3(B[3], i, r, 1)) : 0;
                *(int32_t *)AT3(B[7], i, r, 0) = (int32_t)s;
                *(int32_t *)AT3(B[7], i, r, 1) = (int32_t)e;
            }
        }
        for (int64_t p = c; p < sl; p++, at++) {
            int64_t blk = I64(AT2(B[2], i, p / bs));
            *(int64_t *)AT1(B[8], at) = blk * bs + p % bs;
            if (B[9].held) *(int64_t *)AT1(B[9], at) = p;
        }
        *(int32_t *)AT1(B[4], i + 1) = (int32_t)at;
    }
    /* the block table, eight columns at a time: a row's eight ids are one cache line of
       the source, and the staging view is column-major (a sequence's entries S apart), so
       each of the eight columns is written contiguously (the whole pack at batch 256, 64
       columns, on a CPU host: 16.6 us column by column with stride arithmetic, 9.4 so) */
    {
        char *dst = (char *)B[6].b.buf;
        const char *src = (const char *)B[2].b.buf;
        Py_ssize_t d0 = B[6].b.strides[0], d1 = B[6].b.strides[1], s0 = B[2].b.strides[0], s1 = B[2].b.strides[1];
        for (int64_t j0 = 0; j0 < w; j0 += 8) {
            int64_t j1 = j0 + 8 < w ? j0 + 8 : w;
            if (j1 - j0 == 8 && d0 == 4 && s1 == 8) {     /* the usual layout: no stride arithmetic */
                int32_t *c0 = (int32_t *)(dst + j0 * d1), *c1 = (int32_t *)(dst + (j0 + 1) * d1),
                        *c2 = (int32_t *)(dst + (j0 + 2) * d1), *c3 = (int32_t *)(dst + (j0 + 3) * d1),
                        *c4 = (int32_t *)(dst + (j0 + 4) * d1), *c5 = (int32_t *)(dst + (j0 + 5) * d1),
                        *c6 = (int32_t *)(dst + (j0 + 6) * d1), *c7 = (int32_t *)(dst + (j0 + 7) * d1);
                for (Py_ssize_t i = 0; i < n; i++) {
                    const int64_t *r = (const int64_t *)(src + i * s0) + j0;
                    c0[i] = (int32_t)r[0]; c1[i] = (int32_t)r[1]; c2[i] = (int32_t)r[2]; c3[i] = (int32_t)r[3];
                    c4[i] = (int32_t)r[4]; c5[i] = (int32_t)r[5]; c6[i] = (int32_t)r[6]; c7[i] = (int32_t)r[7];
                }
                continue;
            }
            for (Py_ssize_t i = 0; i < n; i++)
                for (int64_t j = j0; j < j1; j++)
                    *(int32_t *)(dst + i * d0 + j * d1) = (int32_t) * (const int64_t *)(src + i * s0 + j * s1);
        }
    }
    for (Py_ssize_t i = n; i < S; i++) {
        *(int32_t *)AT1(B[4], i + 1) = (int32_t)total;
        *(int32_t *)AT1(B[5], i) = 0;
    }
    for (Py_ssize_t t = total; t < T; t++) {
        *(int64_t *)AT1(B[8], t) = -1;
        if (B[9].held) *(int64_t *)AT1(B[9], t) = 0;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(B, 10);
    return result;
}

/* CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream) and
   CUresult cuEventRecord(CUevent, CUstream); a cudaStream_t / cudaEvent_t is the same handle. */
typedef int (*memcpy_h2d_fn)(unsigned long long, const void *, size_t, void *);
typedef int (*event_record_fn)(void *, void *);
static memcpy_h2d_fn memcpy_h2d;
static event_record_fn event_record;
static int driver_state;          /* 0 not looked up, 1 found, -1 not loaded or lacking a symbol */

static int find_driver(void) {
    if (driver_state == 0) {
        driver_state = -1;
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);     /* only a driver already loaded */
        if (lib) {
            memcpy_h2d = (memcpy_h2d_fn)dlsym(lib, "cuMemcpyHtoDAsync_v2");
            event_record = (event_record_fn)dlsym(lib, "cuEventRecord");
            if (memcpy_h2d && event_record) driver_state = 1;
        }
    }
    return driver_state == 1;
}

/* copy_h2d(dst, src, nbytes, stream, event) with device / host addresses and raw handles
   -> 0 when the copy and the event record were both queued; -1 when the driver is not
   loaded, -2 when the copy was refused (nothing queued: the caller copies another way);
   1 when the copy was queued but the record refused (the caller records the event). */
static PyObject *copy_h2d(PyObject *self, PyObject *args) {
    unsigned long long dst, src, nbytes, stream, event;
    if (!PyArg_ParseTuple(args, "KKKKK", &dst, &src, &nbytes, &stream, &event))
        return NULL;
    if (!find_driver())
        return PyLong_FromLong(-1);
    if (memcpy_h2d(dst, (const void *)(uintptr_t)src, (size_t)nbytes, (void *)(uintptr_t)stream) != 0)
        return PyLong_FromLong(-2);
    return PyLong_FromLong(event_record((void *)(uintptr_t)event, (void *)(uintptr_t)stream) != 0 ? 1 : 0);
}

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS, "Step.validate's rules in one pass: block-table columns, or None if broken."},
    {"pack", pack, METH_VARARGS, "Step.pack's writes in one pass (a validated step)."},
    {"copy_h2d", copy_h2d, METH_VARARGS, "A host-to-device copy and an event record on a stream, through the driver."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "graphrt._fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }
