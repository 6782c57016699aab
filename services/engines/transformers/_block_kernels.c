/* The Python module of the C kernels: GGUF block products (_block_products.c), the
 * float32 glue of a decode step (_decode_glue.c) and the whole layer stack of one
 * (_decode_stack.c). Pointers come in as integers
 * (torch's data_ptr()); the Python wrappers (block_linear.py, fused_ops.py) check
 * dtypes, shapes and contiguity before calling.
 *
 * Threads: OpenMP. Built against the libgomp that torch loads (same soname), so
 * these loops share torch's thread pool instead of fighting it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>

#include "_kernels.h"

static int check_shape(long long rows, long long k, long long n, int threads) {
    if (rows < 0 || n < 0 || k <= 0 || k % QK || threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "k must be a positive multiple of 32, rows and n >= 0, threads >= 1");
        return 0;
    }
    return 1;
}

static PyObject *py_q4_1_linear(PyObject *self, PyObject *args) {
    unsigned long long x, qs, d, m, y;
    long long rows, k, n;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKKKLKi", &x, &rows, &k, &qs, &d, &m, &n, &y, &threads))
        return NULL;
    if (!check_shape(rows, k, n, threads)) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = q4_1_linear((const float *)x, rows, k, (const uint8_t *)qs, (const uint16_t *)d,
                         (const uint16_t *)m, n, (float *)y, threads);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_q8_0_linear(PyObject *self, PyObject *args) {
    unsigned long long x, qs, d, y;
    long long rows, k, n;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKKLKi", &x, &rows, &k, &qs, &d, &n, &y, &threads))
        return NULL;
    if (!check_shape(rows, k, n, threads)) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = q8_0_linear((const float *)x, rows, k, (const int8_t *)qs, (const uint16_t *)d, n,
                         (float *)y, threads);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_q4_1_dequant(PyObject *self, PyObject *args) {
    unsigned long long qs, d, m, w;
    long long n, k;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKLLKi", &qs, &d, &m, &n, &k, &w, &threads)) return NULL;
    if (!check_shape(0, k, n, threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    q4_1_dequant((const uint8_t *)qs, (const uint16_t *)d, (const uint16_t *)m, n, k, (float *)w,
                 threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_q8_0_dequant(PyObject *self, PyObject *args) {
    unsigned long long qs, d, w;
    long long n, k;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKi", &qs, &d, &n, &k, &w, &threads)) return NULL;
    if (!check_shape(0, k, n, threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    q8_0_dequant((const int8_t *)qs, (const uint16_t *)d, n, k, (float *)w, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_add_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long h, delta, weight, out;
    long long rows, n;
    float eps;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKfKi", &h, &delta, &rows, &n, &weight, &eps, &out, &threads))
        return NULL;
    if (rows < 0 || n <= 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rows >= 0, n >= 1, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    add_rms_norm((float *)h, (const float *)delta, rows, n, (const float *)weight, eps,
                 (float *)out, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    unsigned long long gate_up, out;
    long long rows, inter;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKi", &gate_up, &rows, &inter, &out, &threads)) return NULL;
    if (rows < 0 || inter <= 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rows >= 0, inter >= 1, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul((const float *)gate_up, rows, inter, (float *)out, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rotary(PyObject *self, PyObject *args) {
    unsigned long long x, cos, sin;
    long long rows, width, heads, dim;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLLLKKi", &x, &rows, &width, &heads, &dim, &cos, &sin, &threads))
        return NULL;
    if (rows < 0 || dim <= 0 || dim % 2 || heads < 0 || heads * dim > width || threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "dim must be even and positive, heads * dim <= width, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rotary((float *)x, rows, width, heads, dim, (const float *)cos, (const float *)sin, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_attend_one(PyObject *self, PyObject *args) {
    unsigned long long q, keys, values, mask, out;
    long long q_row, q_head, kv_row, kv_head, mask_row, rows, heads, kv_heads, columns, dim;
    float scale;
    int threads, ok;
    if (!PyArg_ParseTuple(args, "KLLKKLLKLLLLLLfKi", &q, &q_row, &q_head, &keys, &values, &kv_row,
                          &kv_head, &mask, &mask_row, &rows, &heads, &kv_heads, &columns, &dim,
                          &scale, &out, &threads))
        return NULL;
    if (rows < 0 || kv_heads <= 0 || heads % kv_heads || columns <= 0 || dim <= 0 ||
        threads < 1) {
        PyErr_SetString(PyExc_ValueError, "heads a multiple of kv_heads >= 1, columns and dim "
                                          ">= 1, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ok = attend_one((const float *)q, q_row, q_head, (const float *)keys, (const float *)values,
                    kv_row, kv_head, (const uint8_t *)mask, mask_row, rows, heads, kv_heads,
                    columns, dim, scale, (float *)out, threads);
    Py_END_ALLOW_THREADS
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_decode_stack(PyObject *self, PyObject *args) {
    unsigned long long layers, caches, h, cos, sin, mask, norm, states;
    long long count, rows, heads, kv_heads, dim, column;
    float eps;
    int threads, failed;
    if (!PyArg_ParseTuple(args, "KKLKLLLLKKKLKfKi", &layers, &caches, &count, &h, &rows, &heads,
                          &kv_heads, &dim, &cos, &sin, &mask, &column, &norm, &eps, &states,
                          &threads))
        return NULL;
    if (count < 1 || rows < 1 || kv_heads < 1 || heads % kv_heads || dim < 2 || dim % 2 ||
        column < 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "count, rows >= 1, heads a multiple of kv_heads >= 1, "
                                          "dim even, column >= 0, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    failed = decode_stack((const StackLayer *)layers, (const StackCache *)caches, count,
                          (float *)h, rows, heads, kv_heads, dim, (const float *)cos,
                          (const float *)sin, (const uint8_t *)mask, column, (const float *)norm,
                          eps, (float *)states, threads);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* The layout of the structs decode_stack reads, for the ctypes mirror to check. */
static PyObject *py_stack_layout(PyObject *self, PyObject *args) {
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n}", "BlockWeight", (Py_ssize_t)sizeof(BlockWeight),
                         "StackLayer", (Py_ssize_t)sizeof(StackLayer), "StackLayer.qkv",
                         (Py_ssize_t)offsetof(StackLayer, qkv), "StackLayer.down",
                         (Py_ssize_t)offsetof(StackLayer, down), "StackCache",
                         (Py_ssize_t)sizeof(StackCache));
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(use_avx512() ? "avx512" : "generic");
}

static PyMethodDef methods[] = {
    {"q4_1_linear", py_q4_1_linear, METH_VARARGS,
     "q4_1_linear(x, rows, k, qs, d, m, n, y, threads): y[rows][n] = x[rows][k] @ W.T, W in Q4_1 blocks"},
    {"q8_0_linear", py_q8_0_linear, METH_VARARGS,
     "q8_0_linear(x, rows, k, qs, d, n, y, threads): y[rows][n] = x[rows][k] @ W.T, W in Q8_0 blocks"},
    {"q4_1_dequant", py_q4_1_dequant, METH_VARARGS,
     "q4_1_dequant(qs, d, m, n, k, w, threads): W[n][k] as float32 into w"},
    {"q8_0_dequant", py_q8_0_dequant, METH_VARARGS,
     "q8_0_dequant(qs, d, n, k, w, threads): W[n][k] as float32 into w"},
    {"simd", py_simd, METH_NOARGS, "The code path this CPU runs: 'avx512' or 'generic'."},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS,
     "add_rms_norm(h, delta, rows, n, weight, eps, out, threads): h += delta (delta 0: none), "
     "out = weight * h * rsqrt(mean(h^2) + eps)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(gate_up, rows, inter, out, threads): out = silu(gate) * up"},
    {"rotary", py_rotary, METH_VARARGS,
     "rotary(x, rows, width, heads, dim, cos, sin, threads): rotary embeddings in place"},
    {"attend_one", py_attend_one, METH_VARARGS,
     "attend_one(q, q_row, q_head, keys, values, kv_row, kv_head, mask, mask_row, rows, heads, "
     "kv_heads, columns, dim, scale, out, threads): one query per row (mask 0: none)"},
    {"decode_stack", py_decode_stack, METH_VARARGS,
     "decode_stack(layers, caches, count, h, rows, heads, kv_heads, dim, cos, sin, mask, column, "
     "norm, eps, states, threads): a decode step through `count` layers (StackLayer, "
     "StackCache arrays; mask 0: none)"},
    {"stack_layout", py_stack_layout, METH_NOARGS,
     "sizeof and offsetof of the structs decode_stack reads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_block_kernels", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__block_kernels(void) { return PyModule_Create(&module); }
