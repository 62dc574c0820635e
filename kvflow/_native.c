/* kvflow._native: one call copies a whole batch of address ranges, without the GIL.
 *
 * batch_copy(dst, src, sizes, stream_min) takes three C-contiguous int64 buffers of equal
 * length. Ranges of at least stream_min bytes are copied with non-temporal stores on x86-64
 * (the destination bypasses the caches, as glibc's memcpy does only for copies of tens of MiB);
 * shorter ones with memcpy. Ranges must not overlap; the caller has checked every address.
 *
 * batch_copy_async(dst, src, sizes, fn, stream, kind) issues the same ranges through a function
 * with cudaMemcpyAsync's signature (device memory), one call per range, without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVFLOW_STREAM 1
#endif

#ifdef KVFLOW_STREAM
#include <emmintrin.h>
#define PAGE 4096

/* 64 bytes: four unaligned loads, four streaming (non-temporal) stores. */
static inline void stream64(char *dst, const char *src)
{
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}

/* Like glibc's large-copy path: four pages at a time, interleaved line by line, so four
 * streams of loads are in flight; then 64-byte steps; then memcpy for the tail. */
static void stream_copy(char *dst, const char *src, size_t n)
{
    /* whole cache lines only: a streamed store that fills half a line is very slow */
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 4 * PAGE; n -= 4 * PAGE, dst += 4 * PAGE, src += 4 * PAGE)
        for (size_t off = 0; off < PAGE; off += 64)
            for (int k = 0; k < 4; k++)
                stream64(dst + k * PAGE + off, src + k * PAGE + off);
    for (; n >= 64; n -= 64, dst += 64, src += 64)
        stream64(dst, src);
    memcpy(dst, src, n);
}
#endif

static int get_int64s(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
         strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The three int64 arrays of a batch: one length, or an exception set and nothing held. */
static int get_ranges(PyObject *dst_obj, PyObject *src_obj, PyObject *size_obj, Py_buffer *dst,
                      Py_buffer *src, Py_buffer *size)
{
    if (get_int64s(dst_obj, dst, "dst") < 0)
        return -1;
    if (get_int64s(src_obj, src, "src") < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    if (get_int64s(size_obj, size, "sizes") < 0) {
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    if (dst->len != size->len || src->len != size->len) {
        PyErr_SetString(PyExc_ValueError, "dst, src and sizes differ in length");
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        PyBuffer_Release(size);
        return -1;
    }
    return 0;
}

static void release_ranges(Py_buffer *dst, Py_buffer *src, Py_buffer *size)
{
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    PyBuffer_Release(size);
}

static PyObject *batch_copy(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *size_obj;
    long long stream_min;
    Py_buffer dst, src, size;
    if (!PyArg_ParseTuple(args, "OOOL", &dst_obj, &src_obj, &size_obj, &stream_min))
        return NULL;
    if (get_ranges(dst_obj, src_obj, size_obj, &dst, &src, &size) < 0)
        return NULL;
    Py_ssize_t count = size.len / 8;
    {
        const int64_t *d = (const int64_t *)dst.buf;
        const int64_t *s = (const int64_t *)src.buf;
        const int64_t *n = (const int64_t *)size.buf;
        int streamed = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
#ifdef KVFLOW_STREAM
            if (stream_min > 0 && n[i] >= stream_min) {
                stream_copy((char *)(intptr_t)d[i], (const char *)(intptr_t)s[i], (size_t)n[i]);
                streamed = 1;
                continue;
            }
#endif
            memcpy((void *)(intptr_t)d[i], (const void *)(intptr_t)s[i], (size_t)n[i]);
        }
#ifdef KVFLOW_STREAM
        if (streamed)
            _mm_sfence(); /* streamed bytes are visible before the caller reports the layer */
#endif
        Py_END_ALLOW_THREADS
        (void)streamed;
    }
    release_ranges(&dst, &src, &size);
    Py_RETURN_NONE;
}

/* The CUDA runtime's cudaMemcpyAsync, by signature: (dst, src, count, kind, stream) -> error.
 * kvflow never links against CUDA; the caller passes the function's address, taken from the
 * runtime library torch has loaded. */
typedef int (*memcpy_async_fn)(void *, const void *, size_t, int, void *);

/* The same signature over host memory: a synchronous memcpy that never fails. It stands in for
 * the CUDA runtime where there is none (tests of the loop, the loop's cost per call). */
static int host_memcpy_async(void *dst, const void *src, size_t n, int kind, void *stream)
{
    (void)kind;
    (void)stream;
    memcpy(dst, src, n);
    return 0;
}

static PyObject *batch_copy_async(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *size_obj;
    unsigned long long fn_addr, stream;
    int kind;
    Py_buffer dst, src, size;
    if (!PyArg_ParseTuple(args, "OOOKKi", &dst_obj, &src_obj, &size_obj, &fn_addr, &stream,
                          &kind))
        return NULL;
    if (fn_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "fn is a null function pointer");
        return NULL;
    }
    if (get_ranges(dst_obj, src_obj, size_obj, &dst, &src, &size) < 0)
        return NULL;
    memcpy_async_fn fn = (memcpy_async_fn)(uintptr_t)fn_addr;
    Py_ssize_t count = size.len / 8, failed = -1;
    int error = 0;
    const int64_t *d = (const int64_t *)dst.buf;
    const int64_t *s = (const int64_t *)src.buf;
    const int64_t *n = (const int64_t *)size.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (n[i] < 0) {
            release_ranges(&dst, &src, &size);
            return PyErr_Format(PyExc_ValueError, "sizes[%zd] is negative", i);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        error = fn((void *)(intptr_t)d[i], (const void *)(intptr_t)s[i], (size_t)n[i], kind,
                   (void *)(uintptr_t)stream);
        if (error != 0) {
            failed = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    release_ranges(&dst, &src, &size);
    return Py_BuildValue("(ni)", failed, error);
}

static PyMethodDef methods[] = {
    {"batch_copy", batch_copy, METH_VARARGS,
     "batch_copy(dst, src, sizes, stream_min): copy every range, GIL released."},
    {"batch_copy_async", batch_copy_async, METH_VARARGS,
     "batch_copy_async(dst, src, sizes, fn, stream, kind) -> (failed, error): call the\n"
     "cudaMemcpyAsync-like function at address fn once per range, GIL released; stops at the\n"
     "first nonzero error and returns that range's index (-1 when every range was issued)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvflow._native", "kvflow's batched copy loop.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#ifdef KVFLOW_STREAM
    PyModule_AddIntConstant(m, "STREAMING", 1);
#else
    PyModule_AddIntConstant(m, "STREAMING", 0);
#endif
    PyObject *host = PyLong_FromVoidPtr((void *)(uintptr_t)&host_memcpy_async);
    if (host == NULL || PyModule_AddObject(m, "HOST_MEMCPY_ASYNC", host) < 0) {
        Py_XDECREF(host);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
