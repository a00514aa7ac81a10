/* psgrad's compiled codec kernels: the CPU passes that numpy cannot fuse.
 *
 * Each function is one pass over a layer: it reads the gradient once, in blocks that stay in
 * L1/L2, and writes the packed message (or adds a message into an accumulator) in the same
 * pass. They reproduce the numpy kernels of _cpu.py, qsgd.py and terngrad.py bit for bit (the
 * bits, codes, indices and every value that numpy computes element by element); sums of many
 * elements (the L1 norm, bucket means) are rounded in another order. tests/test_kernels.py
 * holds both paths to that. Built at install by setup.py (optional: without a compiler psgrad
 * keeps numpy).
 *
 * Layout shared with numpy: bits are packed 8 to a byte, most significant first (np.packbits);
 * a code of `width` bits travels as `width` planes of such bytes, plane j holding bit j.
 *
 * Arguments are Python buffers (numpy arrays, contiguous); the Python side (_cpu.native and its
 * callers) checks dtypes and contiguity before calling, and these functions check byte lengths
 * again. The GIL is released inside: psgrad simulate runs ranks as threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the 8-bytes-at-a-time packing assumes a little-endian CPU; psgrad keeps its numpy kernels"
#endif
#ifdef __SSE2__
#include <emmintrin.h> /* every x86-64 has SSE2; elsewhere the plain C loops below run */
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* one build for every x86-64: an AVX2 copy of each hot loop is chosen at load time when the CPU
   has it, the baseline SSE2 copy otherwise */
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

#define BLOCK 8192 /* elements per block: 32 KB of fp32 and its 8 KB of codes */
#define LOW_BITS 0x0101010101010101ULL
#define GATHER_MSB_FIRST 0x8040201008040201ULL /* byte t's low bit -> bit 63 - t */

static uint64_t SPREAD[256];  /* byte b -> 8 bytes, byte t = bit (7 - t) of b (0 or 1) */
static uint8_t REVERSED[256]; /* byte b with its bits in the opposite order */

/* Eight 0/1 bytes (first element in the lowest byte) -> one packed byte, first element in the
   most significant bit: every byte's bit lands in the top byte with no carries in between. */
static inline uint8_t pack8(uint64_t ones) { return (uint8_t)((ones * GATHER_MSB_FIRST) >> 56); }

static inline uint64_t load8(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Pack n 0/1 bytes into (n + 7) / 8 bytes; a short last group is padded with zero bits. */
static void pack_ones(const uint8_t *ones, Py_ssize_t n, int shift, uint8_t *out) {
    Py_ssize_t full = n / 8;
    for (Py_ssize_t k = 0; k < full; k++) out[k] = pack8((load8(ones + 8 * k) >> shift) & LOW_BITS);
    if (n % 8) {
        uint8_t tail[8] = {0};
        memcpy(tail, ones + 8 * full, (size_t)(n % 8));
        out[full] = pack8((load8(tail) >> shift) & LOW_BITS);
    }
}

/* ---------------------------------------------------------------- sign */

/* negative_bits(x: f32[n], packed: u8[(n+7)/8]) -> sum |x| (float): bit set where x < 0. */
static double negative_bits_run(const float *x, Py_ssize_t n, uint8_t *packed) {
    double l1 = 0.0;
    Py_ssize_t i = 0;
#ifdef __SSE2__
    const __m128 zero = _mm_setzero_ps(), magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
    while (i + 8 <= n) {
        Py_ssize_t stop = i + BLOCK <= n ? i + BLOCK : n / 8 * 8;
        __m128 sum = zero;
        for (; i + 8 <= stop; i += 8) {
            __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
            /* movemask puts element 0 in bit 0; the wire wants it in bit 7 */
            int low = _mm_movemask_ps(_mm_cmplt_ps(a, zero)), high = _mm_movemask_ps(_mm_cmplt_ps(b, zero));
            packed[i / 8] = REVERSED[low | high << 4];
            sum = _mm_add_ps(sum, _mm_add_ps(_mm_and_ps(a, magnitude), _mm_and_ps(b, magnitude)));
        }
        float lanes[4];
        _mm_storeu_ps(lanes, sum);
        l1 += (double)lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
#endif
    uint8_t negative[BLOCK];
    for (Py_ssize_t start = i; start < n; start += BLOCK) {
        Py_ssize_t count = n - start < BLOCK ? n - start : BLOCK;
        for (Py_ssize_t k = 0; k < count; k++) {
            negative[k] = x[start + k] < 0.0f;
            l1 += fabsf(x[start + k]);
        }
        pack_ones(negative, count, 0, packed + start / 8);
    }
    return l1;
}

/* The same bits, and the mean |x| of every bucket of `bucket` elements (the last may be short). */
HOT static void negative_bits_means_run(const float *x, Py_ssize_t n, Py_ssize_t bucket, uint8_t *packed,
                                        float *means) {
    uint8_t negative[BLOCK];
    double sum = 0.0; /* of the bucket in progress, across blocks */
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t count = n - start < BLOCK ? n - start : BLOCK;
        for (Py_ssize_t i = 0; i < count; i++) negative[i] = x[start + i] < 0.0f;
        pack_ones(negative, count, 0, packed + start / 8);
        for (Py_ssize_t at = start; at < start + count;) {
            Py_ssize_t b = at / bucket, end = (b + 1) * bucket;
            Py_ssize_t stop = end < start + count ? end : start + count;
            float lanes[8] = {0};
            Py_ssize_t i = at;
            for (; i + 8 <= stop; i += 8)
                for (int t = 0; t < 8; t++) lanes[t] += fabsf(x[i + t]);
            for (; i < stop; i++) lanes[0] += fabsf(x[i]);
            for (int t = 0; t < 8; t++) sum += lanes[t];
            if (stop == end || stop == n) {
                Py_ssize_t size = (stop == end ? bucket : n - b * bucket);
                means[b] = (float)(sum / (double)size);
                sum = 0.0;
            }
            at = stop;
        }
    }
}

/* out[i] += bit i set ? if_set : if_clear (sign: -scale / +scale; a TernGrad plane: s / 0):
   a 256 x 8 table gives each packed byte's 8 values, added as one vector. */
static void add_bits_run(const uint8_t *packed, Py_ssize_t n, float if_set, float if_clear, float *out) {
    static _Thread_local float rows[256][8];
    const float pair[2] = {if_clear, if_set};
    Py_ssize_t full = n / 8, k = 0;
    if (full >= 1024) { /* the table costs 2,048 stores: worth it for larger tensors only */
        for (int b = 0; b < 256; b++)
            for (int t = 0; t < 8; t++) rows[b][t] = pair[(b >> (7 - t)) & 1];
        for (; k < full; k++) {
            const float *row = rows[packed[k]];
            float *o = out + 8 * k;
#ifdef __SSE2__
            _mm_storeu_ps(o, _mm_add_ps(_mm_loadu_ps(o), _mm_loadu_ps(row)));
            _mm_storeu_ps(o + 4, _mm_add_ps(_mm_loadu_ps(o + 4), _mm_loadu_ps(row + 4)));
#else
            for (int t = 0; t < 8; t++) o[t] += row[t];
#endif
        }
    }
    for (Py_ssize_t i = 8 * k; i < n; i++) out[i] += pair[(packed[i / 8] >> (7 - i % 8)) & 1];
}

static const float SIGN_OF[2] = {1.0f, -1.0f};

/* out[i] += factors[i / bucket] * (bit i set ? -1 : +1): sign's scale per bucket. */
HOT static void add_signs_per_bucket_run(const uint8_t *packed, Py_ssize_t n, const float *factors,
                                         Py_ssize_t bucket, float *out) {
    float signs[BLOCK];
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t count = n - start < BLOCK ? n - start : BLOCK;
        for (Py_ssize_t k = 0; k < (count + 7) / 8; k++) {
            uint64_t bits = SPREAD[packed[start / 8 + k]];
            for (int t = 0; t < 8; t++) signs[8 * k + t] = SIGN_OF[(bits >> (8 * t)) & 1];
        }
        for (Py_ssize_t at = start; at < start + count;) {
            Py_ssize_t b = at / bucket, end = (b + 1) * bucket;
            Py_ssize_t stop = end < start + count ? end : start + count;
            float f = factors[b];
            const float *s = signs + (at - start);
            float *o = out + at;
            for (Py_ssize_t i = 0; i < stop - at; i++) o[i] += s[i] * f;
            at = stop;
        }
    }
}

/* ---------------------------------------------------------------- threshold */

/* The indices (ascending) and values of the entries with |x| >= threshold; their count. */
static Py_ssize_t entries_at_least_run(const float *x, Py_ssize_t n, float threshold, int64_t *indices,
                                       float *values) {
    Py_ssize_t found = 0, i = 0;
#ifdef __SSE2__
    /* most entries are below the threshold: compare 8 at a time, visit only the hits */
    const __m128 bound = _mm_set1_ps(threshold), magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
    for (; i + 8 <= n; i += 8) {
        __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
        int hits = _mm_movemask_ps(_mm_cmpge_ps(_mm_and_ps(a, magnitude), bound)) |
                   _mm_movemask_ps(_mm_cmpge_ps(_mm_and_ps(b, magnitude), bound)) << 4;
        while (hits) {
            int t = __builtin_ctz((unsigned)hits);
            hits &= hits - 1;
            indices[found] = i + t;
            values[found++] = x[i + t];
        }
    }
#endif
    for (; i < n; i++)
        if (fabsf(x[i]) >= threshold) {
            indices[found] = i;
            values[found++] = x[i];
        }
    return found;
}

/* ---------------------------------------------------------------- QSGD */

static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* QSGD's codes, as qsgd.py's numpy path: u = _cpu.Uniforms' draw of element i (in [1, 2)),
   level = trunc(|x| * inv[bucket] + u), at most s + 1, minus 1 (a level >= 1 never exceeds
   s + 1 = 256 by a whole unit, so numpy's cast to uint8 and its clamp give the same codes);
   `width` planes of level bits, and a plane of sign bits. */
HOT static void qsgd_encode_run(const float *x, Py_ssize_t n, const float *inv, Py_ssize_t bucket, int s, int width,
                                uint32_t key, uint8_t *levels, uint8_t *signs) {
    uint8_t codes[BLOCK], negative[BLOCK];
    Py_ssize_t plane = (n + 7) / 8;
    int32_t top = s + 1;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t count = n - start < BLOCK ? n - start : BLOCK;
        for (Py_ssize_t at = start; at < start + count;) {
            Py_ssize_t b = at / bucket, end = (b + 1) * bucket;
            Py_ssize_t stop = end < start + count ? end : start + count;
            float scale = inv[b];
            uint32_t counter = (uint32_t)at * 0x9E3779B9u + key;
            for (Py_ssize_t i = 0; i < stop - at; i++) {
                float value = x[at + i];
                uint32_t word = (fmix32(counter + (uint32_t)i * 0x9E3779B9u) & 0x007FFFFFu) | 0x3F800000u;
                float u;
                memcpy(&u, &word, 4);
                float level = fabsf(value) * scale + u;
                int32_t code = (int32_t)level; /* NaN: INT32_MIN, whose low byte numpy keeps: 0 */
                code = code > top ? top : code;
                codes[at - start + i] = (uint8_t)((uint32_t)code - 1u);
                negative[at - start + i] = value < 0.0f;
            }
            at = stop;
        }
        for (int j = 0; j < width; j++) pack_ones(codes, count, j, levels + j * plane + start / 8);
        pack_ones(negative, count, 0, signs + start / 8);
    }
}

/* ---------------------------------------------------------------- TernGrad */

/* TernGrad's codes, as terngrad.py's numpy path: u = _cpu.Uniforms' draw of element i, kept when
   u * s < |x| + s (so with probability |x| / s), plane 0 = kept and x >= 0, plane 1 = kept and
   x < 0. */
HOT static void terngrad_encode_run(const float *x, Py_ssize_t n, float scale, uint32_t key, uint8_t *codes) {
    uint8_t positive[BLOCK], negative[BLOCK];
    Py_ssize_t plane = (n + 7) / 8;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t count = n - start < BLOCK ? n - start : BLOCK;
        uint32_t counter = (uint32_t)start * 0x9E3779B9u + key;
        for (Py_ssize_t i = 0; i < count; i++) {
            float value = x[start + i];
            uint32_t word = (fmix32(counter + (uint32_t)i * 0x9E3779B9u) & 0x007FFFFFu) | 0x3F800000u;
            float u;
            memcpy(&u, &word, 4);
            uint8_t kept = u * scale < fabsf(value) + scale, below = value < 0.0f;
            positive[i] = kept & !below;
            negative[i] = kept & below;
        }
        pack_ones(positive, count, 0, codes + start / 8);
        pack_ones(negative, count, 0, codes + plane + start / 8);
    }
}

/* The level of each of 8 elements (byte t of the result) from `width` planes of packed bits. */
static inline uint64_t levels8(const uint8_t *levels, Py_ssize_t plane, Py_ssize_t byte, int width) {
    uint64_t codes = 0;
    for (int j = 0; j < width; j++) codes |= SPREAD[levels[j * plane + byte]] << j;
    return codes;
}

/* The factors of elements first..first+count-1 (count <= 8) into f[0..count-1]: (b, boundary) is
   the bucket of the last element seen and where the next one starts, followed as i grows (no
   division per element). */
static inline void factors8(const float *factors, Py_ssize_t bucket, Py_ssize_t first, int count, Py_ssize_t *b,
                            Py_ssize_t *boundary, float *f) {
    for (int t = 0; t < count; t++) {
        while (first + t >= *boundary) ++*b, *boundary += bucket;
        f[t] = factors[*b];
    }
}

/* out[i] += (sign i ? -1 : 1) * level_i * factors[i / bucket], as qsgd.py's numpy decode_add. */
HOT static void qsgd_decode_add_run(const uint8_t *levels, const uint8_t *signs, Py_ssize_t n, const float *factors,
                                    Py_ssize_t bucket, int width, float *out) {
    Py_ssize_t plane = (n + 7) / 8, k = 0, b = 0, boundary = bucket;
#ifdef __SSE2__
    /* 8 elements at a time in vectors; their factors are one broadcast unless a bucket starts
       among them */
    const __m128i none = _mm_setzero_si128();
    for (; k < n / 8; k++) {
        __m128i codes = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)levels8(levels, plane, k, width)), none);
        __m128i flips = _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)SPREAD[signs[k]]), none);
        __m128 factor[2];
        if (8 * k + 8 <= boundary) {
            factor[0] = factor[1] = _mm_set1_ps(factors[b]);
        } else {
            float f[8];
            factors8(factors, bucket, 8 * k, 8, &b, &boundary, f);
            factor[0] = _mm_loadu_ps(f), factor[1] = _mm_loadu_ps(f + 4);
        }
        for (int half = 0; half < 2; half++) {
            __m128i code = half ? _mm_unpackhi_epi16(codes, none) : _mm_unpacklo_epi16(codes, none);
            __m128i flip = half ? _mm_unpackhi_epi16(flips, none) : _mm_unpacklo_epi16(flips, none);
            /* a set sign bit flips the float's sign bit: -level, exactly */
            __m128 value = _mm_xor_ps(_mm_cvtepi32_ps(code), _mm_castsi128_ps(_mm_slli_epi32(flip, 31)));
            float *o = out + 8 * k + 4 * half;
            _mm_storeu_ps(o, _mm_add_ps(_mm_loadu_ps(o), _mm_mul_ps(value, factor[half])));
        }
    }
#endif
    for (; k < plane; k++) { /* without SSE2, and the last partial byte */
        uint64_t codes = levels8(levels, plane, k, width), negative = SPREAD[signs[k]];
        int count = n - 8 * k < 8 ? (int)(n - 8 * k) : 8;
        float f[8];
        factors8(factors, bucket, 8 * k, count, &b, &boundary, f);
        for (int t = 0; t < count; t++) {
            float value = (float)(uint32_t)((codes >> (8 * t)) & 0xFF);
            uint32_t word;
            memcpy(&word, &value, 4);
            word ^= (uint32_t)((negative >> (8 * t)) & 1) << 31;
            memcpy(&value, &word, 4);
            out[8 * k + t] += value * f[t];
        }
    }
}

/* ---------------------------------------------------------------- Python glue */

/* Check that a buffer holds at least `count` items of `size` bytes; set ValueError if not. */
static int fits(const Py_buffer *buf, Py_ssize_t count, Py_ssize_t size, const char *what) {
    if (count < 0 || buf->len < count * size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", what, buf->len, count * size);
        return 0;
    }
    return 1;
}

/* A bucketed sign kernel's buffers: bucket >= 1, `packed` holds a bit per element, `per_bucket` a float per
   bucket; set ValueError if not. */
static int fits_buckets(Py_ssize_t n, Py_ssize_t bucket, const Py_buffer *packed, const Py_buffer *per_bucket,
                        const char *what) {
    if (bucket < 1) {
        PyErr_SetString(PyExc_ValueError, "bucket must be >= 1");
        return 0;
    }
    return fits(packed, (n + 7) / 8, 1, "packed") && fits(per_bucket, (n + bucket - 1) / bucket, 4, what);
}

#define RELEASE(...)                                                                                                   \
    do {                                                                                                               \
        Py_buffer *all_[] = {__VA_ARGS__};                                                                             \
        for (size_t k_ = 0; k_ < sizeof all_ / sizeof *all_; k_++) PyBuffer_Release(all_[k_]);                        \
    } while (0)

static PyObject *negative_bits(PyObject *self, PyObject *args) {
    Py_buffer x, packed;
    if (!PyArg_ParseTuple(args, "y*w*", &x, &packed)) return NULL;
    Py_ssize_t n = x.len / 4;
    double l1 = 0.0;
    if (fits(&packed, (n + 7) / 8, 1, "packed")) {
        Py_BEGIN_ALLOW_THREADS l1 = negative_bits_run(x.buf, n, packed.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&x, &packed);
    return PyErr_Occurred() ? NULL : PyFloat_FromDouble(l1);
}

static PyObject *negative_bits_means(PyObject *self, PyObject *args) {
    Py_buffer x, packed, means;
    Py_ssize_t bucket;
    if (!PyArg_ParseTuple(args, "y*nw*w*", &x, &bucket, &packed, &means)) return NULL;
    Py_ssize_t n = x.len / 4;
    if (fits_buckets(n, bucket, &packed, &means, "means")) {
        Py_BEGIN_ALLOW_THREADS negative_bits_means_run(x.buf, n, bucket, packed.buf, means.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&x, &packed, &means);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static PyObject *add_bits(PyObject *self, PyObject *args) {
    Py_buffer packed, out;
    float if_set, if_clear;
    if (!PyArg_ParseTuple(args, "y*ffw*", &packed, &if_set, &if_clear, &out)) return NULL;
    Py_ssize_t n = out.len / 4;
    if (fits(&packed, (n + 7) / 8, 1, "packed")) {
        Py_BEGIN_ALLOW_THREADS add_bits_run(packed.buf, n, if_set, if_clear, out.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&packed, &out);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static PyObject *add_signs_per_bucket(PyObject *self, PyObject *args) {
    Py_buffer packed, factors, out;
    Py_ssize_t bucket;
    if (!PyArg_ParseTuple(args, "y*y*nw*", &packed, &factors, &bucket, &out)) return NULL;
    Py_ssize_t n = out.len / 4;
    if (fits_buckets(n, bucket, &packed, &factors, "factors")) {
        Py_BEGIN_ALLOW_THREADS add_signs_per_bucket_run(packed.buf, n, factors.buf, bucket, out.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&packed, &factors, &out);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static PyObject *entries_at_least(PyObject *self, PyObject *args) {
    Py_buffer x, indices, values;
    float threshold;
    if (!PyArg_ParseTuple(args, "y*fw*w*", &x, &threshold, &indices, &values)) return NULL;
    Py_ssize_t n = x.len / 4, found = 0;
    if (fits(&indices, n, 8, "indices") && fits(&values, n, 4, "values")) {
        Py_BEGIN_ALLOW_THREADS found = entries_at_least_run(x.buf, n, threshold, indices.buf, values.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&x, &indices, &values);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(found);
}

static PyObject *qsgd_encode(PyObject *self, PyObject *args) {
    Py_buffer x, inv, levels, signs;
    Py_ssize_t bucket;
    int s, width;
    unsigned int key;
    if (!PyArg_ParseTuple(args, "y*y*niiIw*w*", &x, &inv, &bucket, &s, &width, &key, &levels, &signs)) return NULL;
    Py_ssize_t n = x.len / 4, plane = (n + 7) / 8;
    if (bucket < 1 || s < 1 || s > 255 || width < 1 || width > 8)
        PyErr_SetString(PyExc_ValueError, "qsgd_encode: bucket >= 1, levels in 1..255, width in 1..8");
    else if (fits(&inv, (n + bucket - 1) / bucket, 4, "inv") && fits(&levels, width * plane, 1, "levels") &&
             fits(&signs, plane, 1, "signs")) {
        Py_BEGIN_ALLOW_THREADS qsgd_encode_run(x.buf, n, inv.buf, bucket, s, width, (uint32_t)key, levels.buf,
                                               signs.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&x, &inv, &levels, &signs);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static PyObject *terngrad_encode(PyObject *self, PyObject *args) {
    Py_buffer x, codes;
    float scale;
    unsigned int key;
    if (!PyArg_ParseTuple(args, "y*fIw*", &x, &scale, &key, &codes)) return NULL;
    Py_ssize_t n = x.len / 4;
    if (fits(&codes, 2 * ((n + 7) / 8), 1, "codes")) {
        Py_BEGIN_ALLOW_THREADS terngrad_encode_run(x.buf, n, scale, (uint32_t)key, codes.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&x, &codes);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static PyObject *qsgd_decode_add(PyObject *self, PyObject *args) {
    Py_buffer levels, signs, factors, out;
    Py_ssize_t bucket;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*y*niw*", &levels, &signs, &factors, &bucket, &width, &out)) return NULL;
    Py_ssize_t n = out.len / 4, plane = (n + 7) / 8;
    if (bucket < 1 || width < 1 || width > 8)
        PyErr_SetString(PyExc_ValueError, "qsgd_decode_add: bucket >= 1, width in 1..8");
    else if (fits(&levels, width * plane, 1, "levels") && fits(&signs, plane, 1, "signs") &&
             fits(&factors, (n + bucket - 1) / bucket, 4, "factors")) {
        Py_BEGIN_ALLOW_THREADS qsgd_decode_add_run(levels.buf, signs.buf, n, factors.buf, bucket, width, out.buf);
        Py_END_ALLOW_THREADS
    }
    RELEASE(&levels, &signs, &factors, &out);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static PyMethodDef METHODS[] = {
    {"negative_bits", negative_bits, METH_VARARGS, "negative_bits(x, packed) -> sum |x|"},
    {"negative_bits_means", negative_bits_means, METH_VARARGS, "negative_bits_means(x, bucket, packed, means)"},
    {"add_bits", add_bits, METH_VARARGS, "add_bits(packed, if_set, if_clear, out)"},
    {"add_signs_per_bucket", add_signs_per_bucket, METH_VARARGS, "add_signs_per_bucket(packed, factors, bucket, out)"},
    {"entries_at_least", entries_at_least, METH_VARARGS, "entries_at_least(x, threshold, indices, values) -> count"},
    {"qsgd_encode", qsgd_encode, METH_VARARGS, "qsgd_encode(x, inv, bucket, levels, width, key, planes, signs)"},
    {"terngrad_encode", terngrad_encode, METH_VARARGS, "terngrad_encode(x, scale, key, codes)"},
    {"qsgd_decode_add", qsgd_decode_add, METH_VARARGS, "qsgd_decode_add(planes, signs, factors, bucket, width, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_kernels", "psgrad's compiled codec kernels.", -1, METHODS};

PyMODINIT_FUNC PyInit__kernels(void) {
    for (int b = 0; b < 256; b++) {
        uint64_t spread = 0;
        for (int t = 0; t < 8; t++) spread |= (uint64_t)((b >> (7 - t)) & 1) << (8 * t);
        SPREAD[b] = spread;
        uint8_t reversed = 0;
        for (int t = 0; t < 8; t++) reversed |= (uint8_t)(((b >> t) & 1) << (7 - t));
        REVERSED[b] = reversed;
    }
    return PyModule_Create(&MODULE);
}
