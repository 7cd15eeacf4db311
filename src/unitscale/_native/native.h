/* Shared by the native kernels of unitscale (stats.c, rounding.c): compiled by `pip install`
   as optional CPython extensions (see setup.py), with baseline flags only, so that a build
   runs on every CPU of its architecture. */
#ifndef UNITSCALE_NATIVE_H
#define UNITSCALE_NATIVE_H

#include <stdint.h>
#include <string.h>

/* From this many elements, the loops run on OpenMP's threads where the build has OpenMP
   (setup.py adds -fopenmp where the compiler takes it): below it a fork and join costs
   more than it saves. */
#ifndef US_PARALLEL
#define US_PARALLEL 65536
#endif

/* An OpenMP pragma where the build has OpenMP, else nothing (no unknown-pragma warning). */
#ifdef _OPENMP
#define US_OMP(...) _Pragma(#__VA_ARGS__)
#else
#define US_OMP(...)
#endif

/* The hot loops are compiled for several instruction sets and the best one the running CPU
   has is picked when the extension is loaded (GCC's target_clones, an ifunc resolved from
   the CPU's features): the build itself uses the architecture's baseline only, so it runs
   on every CPU of that architecture. Elsewhere (other compilers, architectures or systems)
   the baseline build runs alone. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    __GNUC__ >= 12
#define US_DISPATCH __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define US_DISPATCH
#endif

static inline uint32_t us_bits_of(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return b;
}

static inline float us_float_of(uint32_t b) {
    float v;
    memcpy(&v, &b, 4);
    return v;
}

/* A void* from a Python int holding an address (a tensor's data_ptr()), or NULL with an
   exception set. */
#define US_ADDRESS(object) PyLong_AsVoidPtr(object)

#endif
