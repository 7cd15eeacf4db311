/* The scale statistics of CPU float32/bfloat16 tensors, in one pass: the CPython extension
   unitscale._native._stats, which tracking calls once per tensor (tracking/metrics.py's
   fast_stats, tracking/_native.py). Its values are those of the PyTorch kernel
   (tracking/metrics.py's _stats_kernel), which tests/tracking/test_stats_paths.py checks. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>

#include "native.h"



/* us_stats writes out[0..2] = sum|x|, sum(x - s), sum((x - s)^2) (float64), out[3..4] =
   max|x| and min|x|, out[5] = how many zeros, out[6 + k] = how many |x| <= under[k] (zeros
   included), every value a double (counts are exact to 2**53). The bit patterns of
   magnitudes are non-negative int32 ordered as the values (NaN above Inf), so each count
   is one signed comparison. NaN and Inf are not counted:
   they make the sums non-finite, and the caller reads such tensors otherwise. Exactly
   US_NT thresholds (unused ones are -1: they never count), so that the loop over them
   unrolls and the loop over elements vectorises.
   us_over: counts[k] = how many |x| > over[k] (unused: INT32_MAX), read only where the
   largest magnitude exceeds a threshold. */
#define US_BLOCK 1024
#define US_NT 4

static inline uint32_t us_bits(const void* p, int64_t i, int bf16) {
    if (bf16) {
        uint16_t h;
        memcpy(&h, (const char*)p + 2 * i, 2);
        return ((uint32_t)h) << 16;
    }
    uint32_t b;
    memcpy(&b, (const char*)p + 4 * i, 4);
    return b;
}

US_DISPATCH static void us_stats(const void* x, int64_t n, double shift, const int32_t* under_in,
                            double* out, int bf16) {
    int32_t under[US_NT];
    for (int k = 0; k < US_NT; ++k) under[k] = under_in[k];
    double s_abs = 0.0, s_d = 0.0, s_d2 = 0.0;
    int32_t hi = 0, lo = INT32_MAX;
    int64_t zeros = 0, cu[US_NT] = {0};
    int64_t blocks = (n + US_BLOCK - 1) / US_BLOCK;
    US_OMP(omp parallel for if (n >= US_PARALLEL) schedule(static)
           reduction(+ : s_abs, s_d, s_d2, zeros, cu[:US_NT]) reduction(max : hi)
           reduction(min : lo))
    for (int64_t block = 0; block < blocks; ++block) {
        int64_t start = block * US_BLOCK;
        int64_t stop = start + US_BLOCK < n ? start + US_BLOCK : n;
        double b_abs = 0.0, b_d = 0.0, b_d2 = 0.0;
        int32_t b_hi = 0, b_lo = INT32_MAX, b_zeros = 0, bu[US_NT] = {0};
        for (int64_t i = start; i < stop; ++i) {
            uint32_t bits = us_bits(x, i, bf16);
            int32_t m = (int32_t)(bits & 0x7FFFFFFFu);
            float v;
            memcpy(&v, &bits, 4);
            double dv = (double)v;
            double d = dv - shift;
            b_abs += dv < 0 ? -dv : dv;
            b_d += d;
            b_d2 += d * d;
            b_hi = m > b_hi ? m : b_hi;
            b_lo = m < b_lo ? m : b_lo;
            b_zeros += m == 0;
            for (int k = 0; k < US_NT; ++k) bu[k] += m <= under[k];
        }
        s_abs += b_abs;
        s_d += b_d;
        s_d2 += b_d2;
        hi = b_hi > hi ? b_hi : hi;
        lo = b_lo < lo ? b_lo : lo;
        zeros += b_zeros;
        for (int k = 0; k < US_NT; ++k) cu[k] += bu[k];
    }
    uint32_t hi_bits = (uint32_t)hi, lo_bits = (uint32_t)lo;
    float hi_value, lo_value;
    memcpy(&hi_value, &hi_bits, 4);
    memcpy(&lo_value, &lo_bits, 4);
    out[0] = s_abs;
    out[1] = s_d;
    out[2] = s_d2;
    out[3] = (double)hi_value;
    out[4] = (double)lo_value;
    out[5] = (double)zeros;
    for (int k = 0; k < US_NT; ++k) out[6 + k] = (double)cu[k];
}

US_DISPATCH static void us_over(const void* x, int64_t n, const int32_t* over_in, int64_t* counts,
                           int bf16) {
    int32_t over[US_NT];
    for (int k = 0; k < US_NT; ++k) over[k] = over_in[k];
    int64_t co[US_NT] = {0};
    int64_t blocks = (n + US_BLOCK - 1) / US_BLOCK;
    US_OMP(omp parallel for if (n >= US_PARALLEL) schedule(static) reduction(+ : co[:US_NT]))
    for (int64_t block = 0; block < blocks; ++block) {
        int64_t start = block * US_BLOCK;
        int64_t stop = start + US_BLOCK < n ? start + US_BLOCK : n;
        int32_t bo[US_NT] = {0};
        for (int64_t i = start; i < stop; ++i) {
            int32_t m = (int32_t)(us_bits(x, i, bf16) & 0x7FFFFFFFu);
            for (int k = 0; k < US_NT; ++k) bo[k] += m > over[k];
        }
        for (int k = 0; k < US_NT; ++k) co[k] += bo[k];
    }
    for (int k = 0; k < US_NT; ++k) counts[k] = co[k];
}

/* sum(x - mean) and sum((x - mean)^2) in float64: the variance where the shift was far from
   the mean. */
US_DISPATCH static void us_centred(const void* x, int64_t n, double mean, double* out, int bf16) {
    double s = 0.0, s2 = 0.0;
    US_OMP(omp parallel for if (n >= US_PARALLEL) schedule(static) reduction(+ : s, s2))
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = us_bits(x, i, bf16);
        float v;
        memcpy(&v, &bits, 4);
        double d = (double)v - mean;
        s += d;
        s2 += d * d;
    }
    out[0] = s;
    out[1] = s2;
}

/* The whole summary of a contiguous tensor, in the layout of the device kernel: out[0..6] =
   sum|x|, mean, var, max|x|, min|x|, 0, 0 (NaN and Inf counts); out[7 + k] = how many
   0 < |x| <= under[k]; out[7 + US_NT + k] = how many |x| > over[k] (0 unless max|x| exceeds
   over_min, the lowest used threshold, which saves that pass). The shift is x[0]; a centred
   pass replaces the variance where var <= cancel * E[(x - s)^2]. Returns 1, out undefined,
   where x holds NaN or Inf (max|x| beyond float32's largest finite value), else 0. */
static inline int us_summary(const void* x, int64_t n, const int32_t* under, const int32_t* over,
                             double over_min, double cancel, double* out, int bf16) {
    uint32_t first_bits = us_bits(x, 0, bf16);
    float first;
    memcpy(&first, &first_bits, 4);
    double raw[6 + US_NT];
    us_stats(x, n, (double)first, under, raw, bf16);
    if (!(raw[3] <= 3.4028234663852886e38)) return 1;
    double shifted = raw[1] / (double)n, squares = raw[2] / (double)n;
    double mean = (double)first + shifted;
    double var = squares - shifted * shifted;
    if (var <= cancel * squares && raw[2] > 0) {
        double centred[2];
        us_centred(x, n, mean, centred, bf16);
        double c = centred[0] / (double)n;
        var = centred[1] / (double)n - c * c;
    }
    out[0] = raw[0];
    out[1] = mean;
    out[2] = var;
    out[3] = raw[3];
    out[4] = raw[4];
    out[5] = 0.0;
    out[6] = 0.0;
    for (int k = 0; k < US_NT; ++k) out[7 + k] = raw[6 + k] - raw[5];
    int64_t counts[US_NT] = {0};
    if (raw[3] > over_min) us_over(x, n, over, counts, bf16);
    for (int k = 0; k < US_NT; ++k) out[7 + US_NT + k] = (double)counts[k];
    return 0;
}


static PyObject *us_tensor, *us_parameter, *us_f32, *us_bf16, *us_data_type, *us_fallback;
static PyObject *us_keys, *us_names[11], *us_empty;
static PyObject *s_dtype, *s_is_cpu, *s_is_contiguous, *s_numel, *s_data_ptr, *s_dict;
static PyObject *s_shape, *s_stride;
static int32_t us_under[US_NT], us_over_t[US_NT];
static double us_over_min, us_cancel;
static int us_nu, us_no, us_ready;

#define US_RELEASE_FROM 32768

static PyObject* us_call(PyObject* x, PyObject* name) {
    return PyObject_VectorcallMethod(name, &x, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Strided tensors, as the Python path reads them: one whose elements fill their memory span
   in another order (a transpose or permute of a contiguous tensor: its strides, ordered
   stably, those of a contiguous tensor, dimensions of size 1 aside) in memory order, others
   of at most US_COPY_MAX elements as a contiguous copy in logical order. 1 where x is
   neither (the caller returns None), -1 with an exception set. */
#define US_MAX_DIMS 16
#define US_COPY_MAX (1 << 20)

static int us_strided(PyObject* x, int64_t n, const char* data, int bf16, double* out,
                      int* bad) {
    PyObject* shape = PyObject_GetAttr(x, s_shape);
    if (shape == NULL) return -1;
    PyObject* strides = us_call(x, s_stride);
    if (strides == NULL) {
        Py_DECREF(shape);
        return -1;
    }
    Py_ssize_t nd = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : -1;
    int64_t size[US_MAX_DIMS], stride[US_MAX_DIMS];
    int ok = nd > 0 && nd <= US_MAX_DIMS && PyTuple_Check(strides) &&
             PyTuple_GET_SIZE(strides) == nd;
    for (Py_ssize_t d = 0; ok && d < nd; ++d) {
        size[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
        stride[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, d));
        ok = stride[d] >= 0;
    }
    Py_DECREF(shape);
    Py_DECREF(strides);
    if (PyErr_Occurred()) return -1;
    if (!ok) return 1;
    /* Stable insertion sort of the dimensions by stride (as Python's sorted). */
    int order[US_MAX_DIMS];
    for (int d = 0; d < nd; ++d) {
        int j = d;
        while (j > 0 && stride[order[j - 1]] > stride[d]) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = d;
    }
    int64_t expected = 1;
    int fills = 1;
    for (int k = 0; k < nd && fills; ++k) {
        int d = order[k];
        if (size[d] == 1) continue;
        if (stride[d] != expected) fills = 0;
        expected *= size[d];
    }
    if (fills) {
        *bad = us_summary(data, n, us_under, us_over_t, us_over_min, us_cancel, out, bf16);
        return 0;
    }
    if (n > US_COPY_MAX) return 1;
    int64_t esize = bf16 ? 2 : 4;
    char* copy = (char*)malloc((size_t)(n * esize));
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* Logical order: the last dimension innermost, the others counted like an odometer. */
    int64_t index[US_MAX_DIMS] = {0}, inner = size[nd - 1], step = stride[nd - 1] * esize;
    int64_t rows = n / inner, offset = 0;
    char* to = copy;
    for (int64_t row = 0; row < rows; ++row) {
        const char* from = data + offset * esize;
        for (int64_t i = 0; i < inner; ++i, to += esize, from += step) memcpy(to, from, esize);
        for (int d = (int)nd - 2; d >= 0; --d) {
            offset += stride[d];
            if (++index[d] < size[d]) break;
            offset -= stride[d] * size[d];
            index[d] = 0;
        }
    }
    *bad = us_summary(copy, n, us_under, us_over_t, us_over_min, us_cancel, out, bf16);
    free(copy);
    return 0;
}

static PyObject* py_summary(PyObject* self, PyObject* x) {
    (void)self;
    if (!us_ready) Py_RETURN_NONE;
    PyObject* type = (PyObject*)Py_TYPE(x);
    if (type != us_tensor && type != us_parameter) Py_RETURN_NONE;
    PyObject* dtype = PyObject_GetAttr(x, s_dtype);
    if (dtype == NULL) return NULL;
    Py_DECREF(dtype); /* the dtype objects live as long as torch */
    int bf16 = dtype == us_bf16;
    if (!bf16 && dtype != us_f32) Py_RETURN_NONE;
    PyObject* flag = PyObject_GetAttr(x, s_is_cpu);
    if (flag == NULL) return NULL;
    Py_DECREF(flag);
    if (flag != Py_True) Py_RETURN_NONE;
    flag = us_call(x, s_is_contiguous);
    if (flag == NULL) return NULL;
    Py_DECREF(flag);
    int contiguous = flag == Py_True;
    PyObject* numel = us_call(x, s_numel);
    if (numel == NULL) return NULL;
    long long n = PyLong_AsLongLong(numel);
    if (n <= 0) {
        Py_DECREF(numel);
        if (n == -1 && PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject* address = us_call(x, s_data_ptr);
    if (address == NULL) {
        Py_DECREF(numel);
        return NULL;
    }
    void* data = PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    if (data == NULL && PyErr_Occurred()) {
        Py_DECREF(numel);
        return NULL;
    }
    double out[7 + 2 * US_NT];
    int bad;
    if (!contiguous) {
        int rc = us_strided(x, n, (const char*)data, bf16, out, &bad);
        if (rc != 0) {
            Py_DECREF(numel);
            if (rc < 0) return NULL;
            Py_RETURN_NONE;
        }
    } else if (n >= US_RELEASE_FROM) {
        Py_BEGIN_ALLOW_THREADS
        bad = us_summary(data, n, us_under, us_over_t, us_over_min, us_cancel, out, bf16);
        Py_END_ALLOW_THREADS
    } else {
        bad = us_summary(data, n, us_under, us_over_t, us_over_min, us_cancel, out, bf16);
    }
    if (bad) {
        Py_DECREF(numel);
        Py_RETURN_NONE;
    }
    PyObject* values = PyList_New(7 + us_nu + us_no);
    if (values == NULL) {
        Py_DECREF(numel);
        return NULL;
    }
    Py_ssize_t j = 0;
    for (int i = 0; i < 7 + us_nu; ++i) PyList_SET_ITEM(values, j++, PyFloat_FromDouble(out[i]));
    for (int i = 0; i < us_no; ++i)
        PyList_SET_ITEM(values, j++, PyFloat_FromDouble(out[7 + US_NT + i]));
    for (Py_ssize_t i = 0; i < j; ++i) {
        if (PyList_GET_ITEM(values, i) == NULL) {
            Py_DECREF(values);
            Py_DECREF(numel);
            return NULL;
        }
    }
    PyObject* result = PyTuple_Pack(2, numel, values);
    Py_DECREF(numel);
    Py_DECREF(values);
    return result;
}

static int us_item(PyObject* list, Py_ssize_t i, double* value) {
    PyObject* item = PyList_GET_ITEM(list, i);
    *value = PyFloat_CheckExact(item) ? PyFloat_AS_DOUBLE(item) : PyFloat_AsDouble(item);
    return *value == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int us_set(PyObject* dict, int name, PyObject* value) {
    if (value == NULL) return -1;
    int rc = PyDict_SetItem(dict, us_names[name], value);
    Py_DECREF(value);
    return rc;
}

static PyObject* us_fractions(PyObject* values, Py_ssize_t start, double numel) {
    Py_ssize_t keys = PyTuple_GET_SIZE(us_keys);
    PyObject* fractions = PyDict_New();
    if (fractions == NULL) return NULL;
    for (Py_ssize_t k = 0; k < keys; ++k) {
        double count;
        PyObject* fraction;
        if (us_item(values, start + k, &count) < 0 ||
            (fraction = PyFloat_FromDouble(count / numel)) == NULL) {
            Py_DECREF(fractions);
            return NULL;
        }
        int rc = PyDict_SetItem(fractions, PyTuple_GET_ITEM(us_keys, k), fraction);
        Py_DECREF(fraction);
        if (rc < 0) {
            Py_DECREF(fractions);
            return NULL;
        }
    }
    return fractions;
}

static PyObject* py_to_data(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "to_data(values, numel)");
        return NULL;
    }
    PyObject *values = args[0], *numel_obj = args[1];
    Py_ssize_t keys = us_ready ? PyTuple_GET_SIZE(us_keys) : 0;
    long long numel = PyLong_CheckExact(numel_obj) ? PyLong_AsLongLong(numel_obj) : 0;
    if (numel == -1 && PyErr_Occurred()) PyErr_Clear();
    if (!us_ready || numel <= 0 || !PyList_CheckExact(values) ||
        PyList_GET_SIZE(values) != 7 + 2 * keys)
        /* The rare cases (an empty tensor, a malformed vector: its error) in Python. */
        return PyObject_Vectorcall(us_fallback, args, 2, NULL);
    double v[7];
    for (int i = 0; i < 7; ++i)
        if (us_item(values, i, &v[i]) < 0) return NULL;
    double n = (double)numel, mean = v[1], var = v[2], std, rms;
    if (isnan(var)) {
        std = rms = var;
    } else {
        if (var < 0.0) var = 0.0;
        std = sqrt(var);
        /* Rounded before the sum, as Python rounds it: never fused into one multiply-add. */
        volatile double square = mean * mean;
        rms = sqrt(var + square);
    }
    PyObject* dict = PyDict_New();
    if (dict == NULL) return NULL;
    if (us_set(dict, 0, PyFloat_FromDouble(v[0] / n)) < 0 ||
        us_set(dict, 1, PyFloat_FromDouble(fabs(mean))) < 0 ||
        us_set(dict, 2, PyFloat_FromDouble(std)) < 0 ||
        us_set(dict, 3, PyFloat_FromDouble(v[3])) < 0 ||
        us_set(dict, 4, PyFloat_FromDouble(v[4])) < 0 ||
        us_set(dict, 5, PyFloat_FromDouble(rms)) < 0 ||
        PyDict_SetItem(dict, us_names[6], numel_obj) < 0 ||
        us_set(dict, 7, us_fractions(values, 7, n)) < 0 ||
        us_set(dict, 8, us_fractions(values, 7 + keys, n)) < 0 ||
        us_set(dict, 9, PyLong_FromDouble(v[5])) < 0 ||
        us_set(dict, 10, PyLong_FromDouble(v[6])) < 0) {
        Py_DECREF(dict);
        return NULL;
    }
    PyObject* data = PyBaseObject_Type.tp_new((PyTypeObject*)us_data_type, us_empty, NULL);
    if (data == NULL || PyObject_GenericSetAttr(data, s_dict, dict) < 0) {
        Py_XDECREF(data);
        Py_DECREF(dict);
        return NULL;
    }
    Py_DECREF(dict);
    return data;
}

/* configure(tensor_type, parameter_type, float32, bfloat16, under, over, over_min, cancel,
              data_type, names, format_keys, fallback): under/over are tuples of float32 bit
   patterns (at most US_NT each), names the 11 fields of the record in order. */
static PyObject* py_configure(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *tensor, *parameter, *f32, *bf16, *under, *over, *data_type, *names, *keys;
    PyObject* fallback;
    double over_min, cancel;
    if (!PyArg_ParseTuple(args, "OOOOO!O!ddOO!O!O", &tensor, &parameter, &f32, &bf16,
                          &PyTuple_Type, &under, &PyTuple_Type, &over, &over_min, &cancel,
                          &data_type, &PyTuple_Type, &names, &PyTuple_Type, &keys, &fallback))
        return NULL;
    Py_ssize_t nu = PyTuple_GET_SIZE(under), no = PyTuple_GET_SIZE(over);
    if (nu > US_NT || no > US_NT || PyTuple_GET_SIZE(names) != 11 || !PyType_Check(data_type)) {
        PyErr_SetString(PyExc_ValueError, "configure: bad thresholds, names or record type");
        return NULL;
    }
    for (int k = 0; k < US_NT; ++k) {
        us_under[k] = k < nu ? (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(under, k)) : -1;
        us_over_t[k] = k < no ? (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(over, k)) : INT32_MAX;
    }
    if (PyErr_Occurred()) return NULL;
    PyObject* owned[] = {tensor, parameter, f32, bf16, data_type, keys, fallback};
    for (int i = 0; i < 7; ++i) Py_INCREF(owned[i]);
    us_tensor = tensor, us_parameter = parameter, us_f32 = f32, us_bf16 = bf16;
    us_data_type = data_type, us_keys = keys, us_fallback = fallback;
    for (int i = 0; i < 11; ++i) {
        us_names[i] = PyTuple_GET_ITEM(names, i);
        Py_INCREF(us_names[i]);
    }
    us_over_min = over_min, us_cancel = cancel, us_nu = (int)nu, us_no = (int)no;
    us_ready = 1;
    Py_RETURN_NONE;
}


/* -- the kernel on raw memory: tensors that py_summary declines (other thresholds, float16
   copies, pieces of large strided tensors), called by tracking/_native.py ---------------- */

/* thresholds[0..US_NT) from a tuple of exactly US_NT ints (float32 bit patterns). */
static int us_thresholds(PyObject* tuple, int32_t* thresholds) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != US_NT) {
        PyErr_Format(PyExc_ValueError, "expected a tuple of %d thresholds", US_NT);
        return -1;
    }
    for (int k = 0; k < US_NT; ++k) {
        long value = PyLong_AsLong(PyTuple_GET_ITEM(tuple, k));
        if (value == -1 && PyErr_Occurred()) return -1;
        thresholds[k] = (int32_t)value;
    }
    return 0;
}

static PyObject* us_doubles(const double* values, int n) {
    PyObject* list = PyList_New(n);
    if (list == NULL) return NULL;
    for (int i = 0; i < n; ++i) {
        PyObject* item = PyFloat_FromDouble(values[i]);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* summary_at(address, n, bf16, under, over, over_min, cancel): us_summary's 7 + 2 * US_NT
   values of the n contiguous elements at address, or None where they hold NaN or Inf. */
static PyObject* py_summary_at(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *address, *under_obj, *over_obj;
    long long n;
    int bf16;
    double over_min, cancel;
    if (!PyArg_ParseTuple(args, "OLpOOdd", &address, &n, &bf16, &under_obj, &over_obj,
                          &over_min, &cancel))
        return NULL;
    int32_t under[US_NT], over[US_NT];
    if (us_thresholds(under_obj, under) < 0 || us_thresholds(over_obj, over) < 0) return NULL;
    const void* data = US_ADDRESS(address);
    if (PyErr_Occurred()) return NULL;
    if (n <= 0) {
        PyErr_SetString(PyExc_ValueError, "summary_at: no elements");
        return NULL;
    }
    double out[7 + 2 * US_NT];
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = us_summary(data, n, under, over, over_min, cancel, out, bf16);
    Py_END_ALLOW_THREADS
    if (bad) Py_RETURN_NONE;
    return us_doubles(out, 7 + 2 * US_NT);
}

/* stats_at(address, n, bf16, shift, under): us_stats's 6 + US_NT values. */
static PyObject* py_stats_at(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *address, *under_obj;
    long long n;
    int bf16;
    double shift;
    if (!PyArg_ParseTuple(args, "OLpdO", &address, &n, &bf16, &shift, &under_obj)) return NULL;
    int32_t under[US_NT];
    if (us_thresholds(under_obj, under) < 0) return NULL;
    const void* data = US_ADDRESS(address);
    if (PyErr_Occurred()) return NULL;
    double out[6 + US_NT];
    Py_BEGIN_ALLOW_THREADS
    us_stats(data, n, shift, under, out, bf16);
    Py_END_ALLOW_THREADS
    return us_doubles(out, 6 + US_NT);
}

/* over_at(address, n, bf16, over): how many |x| > over[k], as US_NT floats. */
static PyObject* py_over_at(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *address, *over_obj;
    long long n;
    int bf16;
    if (!PyArg_ParseTuple(args, "OLpO", &address, &n, &bf16, &over_obj)) return NULL;
    int32_t over[US_NT];
    if (us_thresholds(over_obj, over) < 0) return NULL;
    const void* data = US_ADDRESS(address);
    if (PyErr_Occurred()) return NULL;
    int64_t counts[US_NT];
    double values[US_NT];
    Py_BEGIN_ALLOW_THREADS
    us_over(data, n, over, counts, bf16);
    Py_END_ALLOW_THREADS
    for (int k = 0; k < US_NT; ++k) values[k] = (double)counts[k];
    return us_doubles(values, US_NT);
}

/* centred_at(address, n, bf16, mean): (sum(x - mean), sum((x - mean)^2)). */
static PyObject* py_centred_at(PyObject* self, PyObject* args) {
    (void)self;
    PyObject* address;
    long long n;
    int bf16;
    double mean;
    if (!PyArg_ParseTuple(args, "OLpd", &address, &n, &bf16, &mean)) return NULL;
    const void* data = US_ADDRESS(address);
    if (PyErr_Occurred()) return NULL;
    double out[2];
    Py_BEGIN_ALLOW_THREADS
    us_centred(data, n, mean, out, bf16);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dd)", out[0], out[1]);
}

static PyMethodDef us_methods[] = {
    {"summary", (PyCFunction)py_summary, METH_O, "(numel, statistics) of x, or None."},
    {"to_data", (PyCFunction)(void (*)(void))py_to_data, METH_FASTCALL, "stats_to_data."},
    {"configure", py_configure, METH_VARARGS, "Set the types and thresholds."},
    {"summary_at", py_summary_at, METH_VARARGS, "us_summary of raw memory, or None."},
    {"stats_at", py_stats_at, METH_VARARGS, "us_stats of raw memory."},
    {"over_at", py_over_at, METH_VARARGS, "us_over of raw memory."},
    {"centred_at", py_centred_at, METH_VARARGS, "us_centred of raw memory."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef us_module = {PyModuleDef_HEAD_INIT, "_stats", NULL, -1, us_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__stats(void) {
    s_dtype = PyUnicode_InternFromString("dtype");
    s_is_cpu = PyUnicode_InternFromString("is_cpu");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_numel = PyUnicode_InternFromString("numel");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_dict = PyUnicode_InternFromString("__dict__");
    s_shape = PyUnicode_InternFromString("shape");
    s_stride = PyUnicode_InternFromString("stride");
    us_empty = PyTuple_New(0);
    if (!s_dtype || !s_is_cpu || !s_is_contiguous || !s_numel || !s_data_ptr || !s_dict ||
        !s_shape || !s_stride || !us_empty)
        return NULL;
    return PyModule_Create(&us_module);
}
