
/* Rounding of contiguous float32 CPU tensors to a format, in one pass: the CPython extension
   unitscale._native._rounding, called by formats/_native.py. Compiled without reassociation
   or any other relaxation of IEEE arithmetic (setup.py): the subnormal rounding relies on
   (m + c) - c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "native.h"

#define us_bits us_bits_of
#define us_float us_float_of

/* y = x rounded to nearest (ties to even) at `drop` (0..23) fewer mantissa bits than
   float32's, saturating at +-bound. From `smallest_normal` (the format's) down, the step is
   the format's subnormal step: one addition of `magic` (2**(emin + drop)) rounds there.
   NaN stays NaN (clamping and the subnormal branch both keep it). */
US_DISPATCH static void us_nearest_f32(const float* x, float* y, int64_t n, int32_t drop, float bound,
                    float smallest_normal, float magic) {
    const uint32_t odd = drop > 0 ? 1u : 0u;
    const uint32_t half = drop > 0 ? (1u << (drop - 1)) - 1u : 0u;
    const uint32_t keep = drop > 0 ? ~((1u << drop) - 1u) : ~0u;
    US_OMP(omp parallel for if (n >= US_PARALLEL) schedule(static))
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        v = v > bound ? bound : (v < -bound ? -bound : v);
        uint32_t b = us_bits(v);
        float normal = us_float((b + ((b >> drop) & odd) + half) & keep);
        float m = fabsf(v);
        float subnormal = copysignf((m + magic) - magic, normal);
        y[i] = m >= smallest_normal ? normal : subnormal;
    }
}

/* y = x rounded stochastically at `drop` (1..23) fewer mantissa bits, saturating at
   +-bound: uniform random bits added below the kept mantissa, then truncated (a carry moves
   into the exponent). With `shift_small`, magnitudes below the format's smallest normal are
   shifted into its first binade (whose step is the subnormal step) and back. The random
   bits are the hash of _kernels._hashed_random_bits, of the element's index and two seeds:
   the same bits as the compiled path for the same seeds. NaN stays NaN. */
US_DISPATCH static void us_stochastic_f32(const float* x, float* y, int64_t n, int32_t drop, float bound,
                       float smallest_normal, int32_t shift_small, uint32_t seed0,
                       uint32_t seed1) {
    const uint32_t keep = ~((1u << drop) - 1u);
    const int32_t shift = 32 - drop;
    US_OMP(omp parallel for if (n >= US_PARALLEL) schedule(static))
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        float m = fabsf(v);
        m = m > bound ? bound : m;
        int small = shift_small && m < smallest_normal;
        m = small ? m + smallest_normal : m;
        uint32_t key = seed1 ^ ((uint32_t)((uint64_t)i >> 32) * 0x2C1B3C6Du);
        uint32_t h = ((uint32_t)i + seed0) * 0x9E3779B9u;
        h ^= h >> 16;
        h *= 0x7FEB352Du;
        h ^= (h >> 15) ^ key;
        h *= 0x2C1B3C6Du;
        if (drop > 16) h ^= h >> 16; /* changes the low 16 bits only */
        float r = us_float((us_bits(m) + (h >> shift)) & keep);
        r = small ? r - smallest_normal : r;
        y[i] = v != v ? v : copysignf(r, v);
    }
}

/* nearest(x, y, n, drop, bound, smallest_normal, magic): x and y are addresses. */
static PyObject* py_nearest(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *x_obj, *y_obj;
    long long n;
    int drop;
    float bound, smallest_normal, magic;
    if (!PyArg_ParseTuple(args, "OOLifff", &x_obj, &y_obj, &n, &drop, &bound, &smallest_normal,
                          &magic))
        return NULL;
    const float* x = (const float*)US_ADDRESS(x_obj);
    float* y = (float*)US_ADDRESS(y_obj);
    if (PyErr_Occurred()) return NULL;
    if (drop < 0 || drop > 23) {
        PyErr_SetString(PyExc_ValueError, "nearest: drop must be in 0..23");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    us_nearest_f32(x, y, n, drop, bound, smallest_normal, magic);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* stochastic(x, y, n, drop, bound, smallest_normal, shift_small, seed0, seed1). */
static PyObject* py_stochastic(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *x_obj, *y_obj;
    long long n;
    int drop, shift_small;
    float bound, smallest_normal;
    unsigned int seed0, seed1;
    if (!PyArg_ParseTuple(args, "OOLiffpII", &x_obj, &y_obj, &n, &drop, &bound,
                          &smallest_normal, &shift_small, &seed0, &seed1))
        return NULL;
    const float* x = (const float*)US_ADDRESS(x_obj);
    float* y = (float*)US_ADDRESS(y_obj);
    if (PyErr_Occurred()) return NULL;
    if (drop < 1 || drop > 23) {
        PyErr_SetString(PyExc_ValueError, "stochastic: drop must be in 1..23");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    us_stochastic_f32(x, y, n, drop, bound, smallest_normal, shift_small, seed0, seed1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef us_methods[] = {
    {"nearest", py_nearest, METH_VARARGS, "Round to nearest, saturating."},
    {"stochastic", py_stochastic, METH_VARARGS, "Round stochastically, saturating."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef us_module = {PyModuleDef_HEAD_INIT, "_rounding", NULL, -1, us_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rounding(void) { return PyModule_Create(&us_module); }
