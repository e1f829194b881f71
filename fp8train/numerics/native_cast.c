/* fp8train native cast: amax, the scale rule and the fp32/bf16 -> FP8 cast, and the FP8 -> fp32/bf16 decode.
 *
 * Built by fp8train/numerics/native_build.py with the system C compiler (-O3 -march=native) on first use and
 * loaded with ctypes; the Python side passes raw pointers of contiguous CPU tensors. Every byte must equal
 * fp8train's eager quantize (torch ops one by one), which the tests check against ml_dtypes, so this file only
 * restates that chain in a form gcc vectorizes (no branches in the element loops):
 *
 *   amax  = max |x| over a tile, NaN propagating: on the IEEE bit patterns with the sign cleared, unsigned integer
 *           order is float order with every NaN above inf, so an integer max finds a NaN if there is one.
 *   scale = the documented rule (quant.scale_rule, or the OCP MX rule), computed per tile in scalar code.
 *   y     = x / scale in fp32 (a true IEEE division, like torch's div; bf16 inputs are widened exactly first).
 *   code  = round-to-nearest-even of clamp(y, -max, max) onto the FP8 grid, in the integer domain: in the normal
 *           range, adding 2^(22-m) - 1 plus the lowest kept mantissa bit to the fp32 bits and shifting right by
 *           23 - m rounds the mantissa to m bits (a carry moves into the exponent, as it should); below the FP8
 *           format's smallest normal, adding 2^(emin - m + 23) in fp32 makes the FPU round |y| to a multiple of
 *           the FP8 subnormal spacing, and the low bits of the sum are that multiple.
 *   NaN keeps its sign (OCP) or becomes 0x80 (FNUZ); without saturation values past max + half the top spacing
 *   (ties to even at exactly that point) become inf (e5m2) or NaN.
 * The tile is given in memory coordinates of a row-major (rows, cols) matrix, batch of `batch` such matrices:
 * (rows, cols) for per-tensor, (1, cols) per row, (rows, 1) per column, (br, bc) blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_common.h"

#define SPECIAL_IEEE 0 /* e5m2: inf and NaN at the all-ones exponent */
#define SPECIAL_FN 1   /* e4m3fn: only S.1111.111 is NaN */
#define SPECIAL_FNUZ 2 /* no inf, no -0: 0x80 is the NaN */

#define RULE_GIVEN 0   /* scales given per tile */
#define RULE_AMAX 1    /* scale = amax / (max * 2^-margin), optional power-of-two rounding, capped */
#define RULE_MX 2      /* scale = 2^(floor(log2 amax) - emax), E8M0 range */

typedef struct {
    int32_t mantissa_bits, bias, special, saturate, max_is_even;
    int32_t rule, pow2, fp32_divide, mx_emax;
    int32_t dequantize;            /* values out = FP8 value * scale (what a GEMM with scales along K reads) */
    uint32_t max_bits, limit_bits; /* fp32 bits of fmt.max and of max + step_at_max / 2 */
    double divisor, cap, tiny;     /* fmt.max * 2^-margin, max_scale(fmt.max, pow2), 2^-126 */
    float lut[256];                /* FP8 code -> fp32 value (torch's own decode, NaN payloads included) */
} fp8_params;

typedef struct {
    const fp8_params *p;
    const void *x;
    int32_t x_bf16;
    int64_t batch, rows, cols, tile_r, tile_c;
    const float *scale_in;
    uint8_t *data;
    float *scale_out, *amax_out, *values;
    uint16_t *values16; /* the FP8 values as bf16 (exact), written in the same pass */
    int32_t nthreads;
    /* single tile row mode: phase 0 amax, phase 1 cast, phase 2 both per slab of rows (a given scale) */
    int32_t phase;
    uint32_t *partial_amax; /* nthreads x tiles per band */
    float *band_scale;      /* tiles per band */
} job_t;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- amax ---------------------------------------------------------------------------------------------- */
#if defined(__AVX2__)
#include <immintrin.h>
#define STREAMS 4 /* a thread reads this many places of its range at once (below) */
/* Max of the abs bits over n values, read as STREAMS equal parts in lockstep: a core with one sequential stream
 * has too few cache misses in flight to fill the memory bus; four streams each run by the hardware prefetcher
 * measured 1.4x the read speed of one (2-core EPYC, 64 MB). */
static uint32_t absmax_f32(const float *x, int64_t n) {
    const uint32_t *u = (const uint32_t *)x;
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const int64_t part = n / STREAMS / 8 * 8;
    __m256i m[STREAMS];
    for (int s = 0; s < STREAMS; s++) m[s] = _mm256_setzero_si256();
    for (int64_t i = 0; i < part; i += 8)
        for (int s = 0; s < STREAMS; s++)
            m[s] = _mm256_max_epu32(m[s], _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(u + s * part + i)),
                                                           abs_mask));
    for (int s = 1; s < STREAMS; s++) m[0] = _mm256_max_epu32(m[0], m[s]);
    uint32_t lanes[8], mx = 0;
    _mm256_storeu_si256((__m256i *)lanes, m[0]);
    for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
    for (int64_t i = STREAMS * part; i < n; i++) { uint32_t a = u[i] & 0x7FFFFFFFu; mx = a > mx ? a : mx; }
    return mx;
}
#else
static uint32_t absmax_f32(const float *x, int64_t n) {
    const uint32_t *u = (const uint32_t *)x;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) { uint32_t a = u[i] & 0x7FFFFFFFu; m = a > m ? a : m; }
    return m;
}
#endif

#if defined(__AVX2__)
/* The same on bf16 bit patterns (the top halves of fp32 ones: the same order, NaN above inf), 16 per vector. */
static uint32_t absmax_bf16(const uint16_t *x, int64_t n) {
    const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
    const int64_t part = n / STREAMS / 16 * 16;
    __m256i m[STREAMS];
    for (int s = 0; s < STREAMS; s++) m[s] = _mm256_setzero_si256();
    for (int64_t i = 0; i < part; i += 16)
        for (int s = 0; s < STREAMS; s++)
            m[s] = _mm256_max_epu16(m[s], _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + s * part + i)),
                                                           abs_mask));
    for (int s = 1; s < STREAMS; s++) m[0] = _mm256_max_epu16(m[0], m[s]);
    uint16_t lanes[16];
    uint32_t mx = 0;
    _mm256_storeu_si256((__m256i *)lanes, m[0]);
    for (int k = 0; k < 16; k++) mx = lanes[k] > mx ? lanes[k] : mx;
    mx <<= 16;
    for (int64_t i = STREAMS * part; i < n; i++) {
        uint32_t a = ((uint32_t)x[i] << 16) & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx;
}
#else
static uint32_t absmax_bf16(const uint16_t *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) { uint32_t a = ((uint32_t)x[i] << 16) & 0x7FFFFFFFu; m = a > m ? a : m; }
    return m;
}
#endif

static void colmax_f32(const float *x, int64_t n, uint32_t *acc) {
    const uint32_t *u = (const uint32_t *)x;
    for (int64_t i = 0; i < n; i++) { uint32_t a = u[i] & 0x7FFFFFFFu; acc[i] = a > acc[i] ? a : acc[i]; }
}

static void colmax_bf16(const uint16_t *x, int64_t n, uint32_t *acc) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = ((uint32_t)x[i] << 16) & 0x7FFFFFFFu;
        acc[i] = a > acc[i] ? a : acc[i];
    }
}

static uint32_t absmax_any(const job_t *j, int64_t offset, int64_t n) {
    return j->x_bf16 ? absmax_bf16((const uint16_t *)j->x + offset, n) : absmax_f32((const float *)j->x + offset, n);
}

/* Tile amaxes (abs bits) of rows [r0, r1) of matrix b, for every tile column; `work` holds cols uint32. */
static void rows_amax(const job_t *j, int64_t b, int64_t r0, int64_t r1, uint32_t *tile_amax, uint32_t *work) {
    const int64_t cols = j->cols, tc = j->tile_c, ntc = (cols + tc - 1) / tc;
    const int64_t base = b * j->rows * cols;
    for (int64_t t = 0; t < ntc; t++) tile_amax[t] = 0;
    if (tc >= cols) { /* whole rows: one contiguous range */
        tile_amax[0] = absmax_any(j, base + r0 * cols, (r1 - r0) * cols);
        return;
    }
    if (r1 - r0 == 1) { /* reduce each row segment straight away */
        for (int64_t r = r0; r < r1; r++)
            for (int64_t t = 0; t < ntc; t++) {
                int64_t c0 = t * tc, n = (c0 + tc < cols ? tc : cols - c0);
                uint32_t m = absmax_any(j, base + r * cols + c0, n);
                tile_amax[t] = m > tile_amax[t] ? m : tile_amax[t];
            }
        return;
    }
    memset(work, 0, (size_t)cols * 4); /* column maxima over the rows, then per tile column */
    for (int64_t r = r0; r < r1; r++) {
        if (j->x_bf16) colmax_bf16((const uint16_t *)j->x + base + r * cols, cols, work);
        else colmax_f32((const float *)j->x + base + r * cols, cols, work);
    }
    for (int64_t t = 0; t < ntc; t++) {
        int64_t c0 = t * tc, n = (c0 + tc < cols ? tc : cols - c0);
        uint32_t m = 0;
        for (int64_t c = 0; c < n; c++) m = work[c0 + c] > m ? work[c0 + c] : m;
        tile_amax[t] = m;
    }
}

/* ---- scale rules (scalar, once per tile) ---------------------------------------------------------------- */
static float rule_scale(const fp8_params *p, float amax) {
    if (p->rule == RULE_MX) { /* on the bits: frexp and ldexp here cost more than the cast of a 1x32 tile */
        if (!(isfinite(amax) && amax > 0.0f)) return 1.0f;
        const uint32_t bits = f2u(amax), field = bits >> 23; /* amax > 0: no sign bit */
        /* floor(log2 amax): the unbiased exponent, or for a subnormal the top set bit of m * 2^-149 */
        const int floor_log2 = field ? (int)field - 127 : (31 - __builtin_clz(bits)) - 149;
        int shared = floor_log2 - p->mx_emax;
        shared = shared < -127 ? -127 : shared > 127 ? 127 : shared;
        return u2f(shared >= -126 ? (uint32_t)(shared + 127) << 23 : 1u << 22); /* 2^-127: a subnormal */
    }
    if (p->fp32_divide) { /* quant.scale_rule's fp32 branch: one correctly rounded fp32 division */
        float s = amax / (float)p->divisor;
        if (!(amax > 0.0f)) s = 1.0f;
        if (isinf(s)) s = 1.0f;
        s = s < (float)p->tiny ? (float)p->tiny : s;
        return s > (float)p->cap ? (float)p->cap : s;
    }
    double s = (double)amax / p->divisor;
    if (p->pow2 && isfinite(s) && s > 0.0) { /* round UP to a power of two (exactly: frexp, not log2) */
        int e;
        double f = frexp(s, &e);
        s = ldexp(1.0, f == 0.5 ? e - 1 : e);
    }
    if (!(amax > 0.0f)) s = 1.0;
    if (isinf(s)) s = 1.0;
    s = s < p->tiny ? p->tiny : s;
    s = s > p->cap ? p->cap : s;
    return (float)s;
}

/* ---- the cast ------------------------------------------------------------------------------------------- */
/* The cast's constants as plain values: the loops keep a local copy (uint8 stores may alias any pointer, so
 * constants read through one would be reloaded after every store, and the loop would not vectorize). The three
 * special-value conventions are constants too (no branch on the format inside the loop):
 *                   NaN code            overflow code (not saturating)   sign of a value that rounds to 0
 *   ieee (e5m2)     0x7F | sign         0x7C | sign (+-inf)              kept (-0)
 *   fn (e4m3fn)     0x7F | sign         0x7F (eager makes it a +NaN)     kept (-0)
 *   fnuz            0x80                0x80                             dropped (0x80 is the NaN)
 * (ieee and fn share one loop: they differ only in the overflow code, a constant.) */
typedef struct {
    uint32_t shift, round_half, rebias, min_normal_bits, max_bits, overflow_from;
    uint32_t overflow_code, overflow_sign;
    float magic;
    /* fp32 values of the NaN and overflow codes, + and - (from the decode table: torch's NaN payloads) */
    float nan_value[2], overflow_value[2];
} enc_t;

static enc_t enc_of(const fp8_params *p) {
    const int32_t m = p->mantissa_bits;
    enc_t e;
    e.shift = (uint32_t)(23 - m);
    e.round_half = (1u << (22 - m)) - 1u;
    e.rebias = (uint32_t)(127 - p->bias) << m;
    e.min_normal_bits = (uint32_t)(127 + 1 - p->bias) << 23;
    e.max_bits = p->max_bits;
    /* |y| bits at or above this overflow; exactly at max + half a step is a tie: it goes to even, which is
     * down to max when max's last mantissa bit is 0 */
    e.overflow_from = p->saturate ? 0xFFFFFFFFu : p->limit_bits + (p->max_is_even ? 1u : 0u);
    e.overflow_code = p->special == SPECIAL_FNUZ ? 0x80u : p->special == SPECIAL_FN ? 0x7Fu : 0x7Cu;
    e.overflow_sign = p->special == SPECIAL_IEEE ? 0x80u : 0u;
    e.magic = u2f((uint32_t)(127 + 1 - p->bias - m + 23) << 23); /* 2^(emin - m + 23): ulp = subnormal step */
    const uint32_t nan_code = p->special == SPECIAL_FNUZ ? 0x80u : 0x7Fu;
    const uint32_t nan_sign = p->special == SPECIAL_FNUZ ? 0u : 0x80u;
    e.nan_value[0] = p->lut[nan_code];
    e.nan_value[1] = p->lut[nan_code | nan_sign];
    e.overflow_value[0] = p->lut[e.overflow_code];
    e.overflow_value[1] = p->lut[e.overflow_code | e.overflow_sign];
    return e;
}

/* One fp32 value y (already x / scale) -> FP8 code. Branch-free, so the loop vectorizes; `saturate` and `kind`
 * are compile-time constants at every call (one specialized loop each: fewer live vectors, no spills). */
static inline uint32_t select_u32(uint32_t cond, uint32_t a, uint32_t b) { /* cond ? a : b, cond 0 or 1 */
    const uint32_t mask = 0u - cond; /* gcc if-converts this; some ternaries here it would not */
    return (a & mask) | (b & ~mask);
}

static inline __attribute__((always_inline)) uint32_t encode(const enc_t *e, float y, const int saturate,
                                                              const int kind) {
    const uint32_t u = f2u(y), sign_byte = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    const uint32_t is_nan = a > 0x7F800000u;
    const uint32_t clamped = a < e->max_bits ? a : e->max_bits;
    /* normal range: round the fp32 mantissa to m bits (ties to even), then rebias the exponent */
    const uint32_t rounded = (clamped + e->round_half + ((clamped >> e->shift) & 1u)) >> e->shift;
    const uint32_t normal_code = rounded - e->rebias;
    /* below the smallest normal: the FPU's addition rounds to the subnormal spacing */
    const uint32_t sub_code = f2u(u2f(clamped) + e->magic) - f2u(e->magic);
    const uint32_t magnitude = select_u32(clamped < e->min_normal_bits, sub_code, normal_code);
    uint32_t code;
    if (kind == SPECIAL_FNUZ) {
        code = magnitude | (sign_byte & (0u - (uint32_t)(magnitude != 0)));
        code = select_u32(is_nan, 0x80u, code);
    } else {
        code = magnitude | sign_byte;
        code = select_u32(is_nan, 0x7Fu | sign_byte, code);
    }
    if (!saturate) {
        const uint32_t overflow = (a >= e->overflow_from) & !is_nan;
        code = select_u32(overflow, e->overflow_code | (sign_byte & e->overflow_sign), code);
    }
    return code;
}

static inline __attribute__((always_inline)) void encode_loop(const enc_t *e_in, const float *y, int64_t n,
                                                               uint8_t *out, const int saturate, const int kind) {
    const enc_t e = *e_in; /* a local copy: the byte stores below cannot alias it */
    for (int64_t i = 0; i < n; i++) out[i] = (uint8_t)encode(&e, y[i], saturate, kind);
}

static void encode_chunk(const enc_t *e, int32_t saturate, int32_t kind, const float *y, int64_t n, uint8_t *out) {
    if (kind == SPECIAL_FNUZ) {
        if (saturate) encode_loop(e, y, n, out, 1, SPECIAL_FNUZ);
        else encode_loop(e, y, n, out, 0, SPECIAL_FNUZ);
    } else {
        if (saturate) encode_loop(e, y, n, out, 1, SPECIAL_FN);
        else encode_loop(e, y, n, out, 0, SPECIAL_FN);
    }
}

#if defined(__AVX2__)
/* The same encode, 8 lanes at a time with AVX2 intrinsics (gcc's own vectorization of `encode` spills and
 * converts masks back and forth: half the speed). Also gives the FP8 values: for a normal result the rounded
 * fp32 bits are `rounded << shift`, for a subnormal one the sum minus the magic constant, for NaN/overflow the
 * table's values. */
typedef struct {
    __m256i abs_mask, max_bits, round_half, one, rebias, min_normal, magic_bits, inf_bits, x80, x7f;
    __m256i overflow_below, overflow_code, overflow_sign, zero;
    __m256 magic, nan_pos, nan_neg, overflow_pos, overflow_neg;
    __m128i shift;
} venc_t;

static venc_t venc_of(const enc_t *e) {
    venc_t v;
    v.abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    v.max_bits = _mm256_set1_epi32((int)e->max_bits);
    v.round_half = _mm256_set1_epi32((int)e->round_half);
    v.one = _mm256_set1_epi32(1);
    v.rebias = _mm256_set1_epi32((int)e->rebias);
    v.min_normal = _mm256_set1_epi32((int)e->min_normal_bits);
    v.magic_bits = _mm256_set1_epi32((int)f2u(e->magic));
    v.inf_bits = _mm256_set1_epi32(0x7F800000);
    v.x80 = _mm256_set1_epi32(0x80);
    v.x7f = _mm256_set1_epi32(0x7F);
    /* a >= overflow_from as a signed a > overflow_from - 1 (every |y| bit pattern is below 2^31) */
    v.overflow_below = _mm256_set1_epi32((int)(e->overflow_from > 0x7FFFFFFFu ? 0x7FFFFFFFu : e->overflow_from - 1));
    v.overflow_code = _mm256_set1_epi32((int)e->overflow_code);
    v.overflow_sign = _mm256_set1_epi32((int)e->overflow_sign);
    v.zero = _mm256_setzero_si256();
    v.magic = _mm256_set1_ps(e->magic);
    v.nan_pos = _mm256_set1_ps(e->nan_value[0]);
    v.nan_neg = _mm256_set1_ps(e->nan_value[1]);
    v.overflow_pos = _mm256_set1_ps(e->overflow_value[0]);
    v.overflow_neg = _mm256_set1_ps(e->overflow_value[1]);
    v.shift = _mm_cvtsi32_si128((int)e->shift);
    return v;
}

static inline __attribute__((always_inline)) __m256i vencode(const venc_t *v, __m256 y, float *values,
                                                              const int saturate, const int fnuz) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256i a = _mm256_and_si256(u, v->abs_mask);
    const __m256i sign32 = _mm256_andnot_si256(v->abs_mask, u);
    const __m256i sign_byte = _mm256_srli_epi32(sign32, 24);
    const __m256i clamped = _mm256_min_epu32(a, v->max_bits);
    const __m256i low_bit = _mm256_and_si256(_mm256_srl_epi32(clamped, v->shift), v->one);
    const __m256i rounded = _mm256_srl_epi32(
        _mm256_add_epi32(_mm256_add_epi32(clamped, v->round_half), low_bit), v->shift);
    const __m256i normal_code = _mm256_sub_epi32(rounded, v->rebias);
    const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(clamped), v->magic);
    const __m256i sub_code = _mm256_sub_epi32(_mm256_castps_si256(sum), v->magic_bits);
    const __m256i is_sub = _mm256_cmpgt_epi32(v->min_normal, clamped);
    const __m256i magnitude = _mm256_blendv_epi8(normal_code, sub_code, is_sub);
    const __m256i is_nan = _mm256_cmpgt_epi32(a, v->inf_bits);
    /* FNUZ has no -0: the sign goes only on a nonzero magnitude */
    const __m256i sign_kept = fnuz ? _mm256_andnot_si256(_mm256_cmpeq_epi32(magnitude, v->zero), sign32) : sign32;
    __m256i code = _mm256_or_si256(magnitude, _mm256_srli_epi32(sign_kept, 24));
    code = _mm256_blendv_epi8(code, fnuz ? v->x80 : _mm256_or_si256(v->x7f, sign_byte), is_nan);
    __m256i overflow = v->zero;
    if (!saturate) {
        overflow = _mm256_andnot_si256(is_nan, _mm256_cmpgt_epi32(a, v->overflow_below));
        code = _mm256_blendv_epi8(code, _mm256_or_si256(v->overflow_code, _mm256_and_si256(sign_byte,
                                                                                      v->overflow_sign)), overflow);
    }
    if (values) {
        const __m256 normal_value = _mm256_castsi256_ps(_mm256_sll_epi32(rounded, v->shift));
        const __m256 sub_value = _mm256_sub_ps(sum, v->magic);
        __m256 value = _mm256_blendv_ps(normal_value, sub_value, _mm256_castsi256_ps(is_sub));
        value = _mm256_or_ps(value, _mm256_castsi256_ps(sign_kept));
        value = _mm256_blendv_ps(value, fnuz ? v->nan_pos : _mm256_blendv_ps(v->nan_pos, v->nan_neg, y),
                                 _mm256_castsi256_ps(is_nan));
        if (!saturate)
            value = _mm256_blendv_ps(value, _mm256_blendv_ps(v->overflow_pos, v->overflow_neg, y),
                                     _mm256_castsi256_ps(overflow));
        _mm256_storeu_ps(values, value);
    }
    return code;
}

/* One scale per tile of `width` columns (a multiple of 32) along a row, the segment starting at column col0:
 * each 32-column step of the vector loop takes its tile's scale, instead of a per-column copy of the scales
 * (MX's 1x32 tiles: that copy cost as much as the cast). */
typedef struct {
    const float *scale;
    int64_t width, col0;
} tiles_t;

/* x / scale for 8 lanes from element i of x (one scale, or one per column from col_scale + i): the same IEEE
 * division as divide_chunk, kept in registers (through a buffer, the cast pass measured 1.3x slower). */
static inline __attribute__((always_inline)) __m256 vdivide(const void *x, int64_t i, const float *col_scale,
                                                             __m256 scale, const int bf16) {
    __m256 xv;
    if (bf16) /* bf16 is the top half of an fp32: widen exactly */
        xv = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    else
        xv = _mm256_loadu_ps((const float *)x + i);
    return _mm256_div_ps(xv, col_scale ? _mm256_loadu_ps(col_scale + i) : scale);
}

/* 32 values per step -> 32 bytes: two saturating packs (codes are 0..255) and a lane fix-up. */
static inline __attribute__((always_inline)) int64_t vencode_loop(const enc_t *e, const void *x, int64_t n,
                                                                   const float *col_scale, float scale,
                                                                   const tiles_t *tiles, uint8_t *out,
                                                                   float *values, const int saturate,
                                                                   const int fnuz, const int bf16) {
    const venc_t v = venc_of(e);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 s = _mm256_set1_ps(scale);
    int64_t tile = tiles ? tiles->col0 / tiles->width : 0, left = tiles ? tiles->width - tiles->col0 % tiles->width : 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        if (tiles) { /* 32 columns inside one tile (its width a multiple of 32): its scale, broadcast */
            s = _mm256_set1_ps(tiles->scale[tile]);
            left -= 32;
            if (left == 0) tile++, left = tiles->width;
        }
        float *vals = values ? values + i : NULL;
        const __m256i c0 = vencode(&v, vdivide(x, i, col_scale, s, bf16), vals, saturate, fnuz);
        const __m256i c1 = vencode(&v, vdivide(x, i + 8, col_scale, s, bf16), vals ? vals + 8 : NULL, saturate,
                                   fnuz);
        const __m256i c2 = vencode(&v, vdivide(x, i + 16, col_scale, s, bf16), vals ? vals + 16 : NULL,
                                   saturate, fnuz);
        const __m256i c3 = vencode(&v, vdivide(x, i + 24, col_scale, s, bf16), vals ? vals + 24 : NULL,
                                   saturate, fnuz);
        const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    return i; /* the caller encodes the tail */
}

/* x points at the segment's first element (fp32 or bf16). */
static int64_t encode_chunk_avx2(const enc_t *e, int32_t saturate, int32_t kind, const void *x, int32_t x_bf16,
                                 int64_t n, const float *col_scale, float scale, const tiles_t *tiles, uint8_t *out,
                                 float *values) {
    const int fnuz = kind == SPECIAL_FNUZ;
#define VLOOP(SAT, FNUZ, BF16) vencode_loop(e, x, n, col_scale, scale, tiles, out, values, SAT, FNUZ, BF16)
    if (x_bf16) {
        if (saturate) return fnuz ? VLOOP(1, 1, 1) : VLOOP(1, 0, 1);
        return fnuz ? VLOOP(0, 1, 1) : VLOOP(0, 0, 1);
    }
    if (saturate) return fnuz ? VLOOP(1, 1, 0) : VLOOP(1, 0, 0);
    return fnuz ? VLOOP(0, 1, 0) : VLOOP(0, 0, 0);
#undef VLOOP
}
#endif

#define CHUNK 512
#define PREFETCH_AHEAD (16 * CHUNK) /* elements (32 KB of fp32): nearer was slower, 2-core EPYC, 16M elements */

/* The next chunks' input, requested now: the encode is long enough that the hardware prefetcher alone falls
 * behind (measured: half the read bandwidth of a plain amax pass). */
static inline void prefetch_ahead(const void *x, int32_t x_bf16, int64_t offset, int64_t n) {
    const char *ahead = (const char *)x + (offset + PREFETCH_AHEAD) * (x_bf16 ? 2 : 4);
    for (int64_t b = 0; b < n * (x_bf16 ? 2 : 4); b += 64) __builtin_prefetch(ahead + b, 0, 3);
}

/* y = x / scale for one chunk (one scale, or one per column); bf16 is widened exactly first. */
static void divide_chunk(const void *x, int32_t x_bf16, int64_t offset, int64_t n, const float *col_scale,
                         float scale, float *y) {
    if (x_bf16) {
        const uint16_t *xb = (const uint16_t *)x + offset;
        if (col_scale) for (int64_t i = 0; i < n; i++) y[i] = u2f((uint32_t)xb[i] << 16) / col_scale[i];
        else for (int64_t i = 0; i < n; i++) y[i] = u2f((uint32_t)xb[i] << 16) / scale;
    } else {
        const float *xf = (const float *)x + offset;
        if (col_scale) for (int64_t i = 0; i < n; i++) y[i] = xf[i] / col_scale[i];
        else for (int64_t i = 0; i < n; i++) y[i] = xf[i] / scale;
    }
}

/* Row segment [offset, offset + n): x / scale (one scale, one per column, or one per tile: `tiles`, which only
 * the AVX2 loop takes, for segments whose length is a multiple of 32), cast, values. */
static void cast_segment(const job_t *j, int64_t offset, int64_t n, const float *col_scale, float scale,
                         const tiles_t *tiles) {
    const enc_t e = enc_of(j->p);
    const int32_t saturate = j->p->saturate, kind = j->p->special;
    const float *lut = j->p->lut;
    float y[CHUNK], vbuf[CHUNK];
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t len = n - c0 < CHUNK ? n - c0 : CHUNK;
        uint8_t *o = j->data + offset + c0;
        const float *cs = col_scale ? col_scale + c0 : NULL;
        prefetch_ahead(j->x, j->x_bf16, offset + c0, len);
        float *v = j->values ? j->values + offset + c0 : j->values16 ? vbuf : NULL; /* bf16 only: via vbuf */
        int64_t done = 0;
#if defined(__AVX2__)
        const void *xs = (const char *)j->x + (offset + c0) * (j->x_bf16 ? 2 : 4);
        const tiles_t chunk_tiles = tiles ? (tiles_t){tiles->scale, tiles->width, tiles->col0 + c0} : (tiles_t){0};
        done = encode_chunk_avx2(&e, saturate, kind, xs, j->x_bf16, len, cs, scale, tiles ? &chunk_tiles : NULL, o,
                                 v);
#endif
        if (done < len) {
            divide_chunk(j->x, j->x_bf16, offset + c0 + done, len - done, cs ? cs + done : NULL, scale, y);
            encode_chunk(&e, saturate, kind, y, len - done, o + done);
        }
        if (v) /* the values of the tail (all of them without AVX2), while the codes are in L1 */
            for (int64_t i = done; i < len; i++) v[i] = lut[o[i]];
        if (v && j->p->dequantize) { /* one fp32 product per value, as torch's values * scale */
            if (col_scale) for (int64_t i = 0; i < len; i++) v[i] = v[i] * col_scale[c0 + i];
            else for (int64_t i = 0; i < len; i++) v[i] = v[i] * scale;
        }
        if (j->values16) { /* from the values still in L1: an FP8 value is exact in bf16 (its top 16 bits), and a
                            * NaN becomes 0xFFFF, as torch's fp32 -> bf16 conversion makes it */
            uint16_t *v16 = j->values16 + offset + c0;
            for (int64_t i = 0; i < len; i++) {
                const uint32_t u = f2u(v[i]);
                v16[i] = (uint16_t)select_u32((u & 0x7FFFFFFFu) > 0x7F800000u, 0xFFFFu, u >> 16);
            }
        }
    }
}

/* Cast rows [r0, r1) of matrix b, whose tile row has scales `tile_scale` (one per tile column). */
static void cast_rows(const job_t *j, int64_t b, int64_t r0, int64_t r1, const float *tile_scale, float *col_scale) {
    const int64_t cols = j->cols, tc = j->tile_c, ntc = (cols + tc - 1) / tc;
    const int64_t base = b * j->rows * cols;
    if (ntc == 1) { /* one scale across whole rows: the rows are one contiguous range of memory, cast as one segment
                     * (row by row, a 1024x64 tensor paid the segment set-up 1024 times: 3x the time of the cast) */
        cast_segment(j, base + r0 * cols, (r1 - r0) * cols, NULL, tile_scale[0], NULL);
        return;
    }
#if defined(__AVX2__)
    /* tiles a multiple of 32 wide on rows a multiple of 32 long: one segment per row, each 32-column step with
     * its tile's scale (MX 1x32: 1.7x, 1x128: 1.25x the speed of the two ways below, 2-core Zen 5 EPYC) */
    if (ntc > 1 && tc % 32 == 0 && cols % 32 == 0 && !j->p->dequantize) {
        const tiles_t tiles = {tile_scale, tc, 0};
        for (int64_t r = r0; r < r1; r++) cast_segment(j, base + r * cols, cols, NULL, 0.0f, &tiles);
        return;
    }
#endif
    /* otherwise one scale per column, one loop over the row: for narrow tiles (below 64 wide: 1x32 rows cast
     * 1.8x faster so than as 32-element segments, each paying the segment set-up), and for tall tile rows, where
     * the expansion is paid once for many rows (128x128: +20-30%); else segments of one tile each */
    const int per_column = ntc > 1 && (tc < 64 || r1 - r0 >= 16);
    if (per_column) /* (no division per column: that costs more than the cast of a 1xN tile row) */
        for (int64_t t = 0, c = 0; t < ntc; t++)
            for (int64_t k = 0; k < tc && c < cols; k++, c++) col_scale[c] = tile_scale[t];
    for (int64_t r = r0; r < r1; r++) {
        if (per_column) {
            cast_segment(j, base + r * cols, cols, col_scale, 0.0f, NULL);
            continue;
        }
        for (int64_t t = 0; t < ntc; t++) {
            int64_t c0 = t * tc, n = (c0 + tc < cols ? tc : cols - c0);
            cast_segment(j, base + r * cols + c0, n, NULL, tile_scale[t], NULL);
        }
    }
}

/* Scales (and amax) of one tile row from its tile amax bits; writes the outputs at grid row `grid_row`. */
static void tile_row_scales(const job_t *j, int64_t grid_row, const uint32_t *tile_amax, float *scale_row) {
    const int64_t ntc = (j->cols + j->tile_c - 1) / j->tile_c;
    for (int64_t t = 0; t < ntc; t++) {
        float amax = tile_amax[t] > 0x7F800000u ? NAN : u2f(tile_amax[t]);
        float s = j->p->rule != RULE_GIVEN ? rule_scale(j->p, amax)
                  : j->scale_in ? j->scale_in[grid_row * ntc + t] : 1.0f; /* no scale_in: amax only */
        scale_row[t] = s;
        if (j->scale_out) j->scale_out[grid_row * ntc + t] = s;
        if (j->amax_out) j->amax_out[grid_row * ntc + t] = amax;
    }
}

typedef struct { job_t *job; int32_t id; } worker_t;

static int64_t ntile_rows(const job_t *j) { return (j->rows + j->tile_r - 1) / j->tile_r; }

/* Many tile rows: each thread takes a contiguous range of them, amax + scales + cast per tile row while its
 * rows are still in cache. */
static void *band_worker(void *arg) {
    worker_t *w = (worker_t *)arg;
    job_t *j = w->job;
    const int64_t ntr = ntile_rows(j), ntc = (j->cols + j->tile_c - 1) / j->tile_c, nbands = j->batch * ntr;
    const int64_t lo = nbands * w->id / j->nthreads, hi = nbands * (w->id + 1) / j->nthreads;
    uint32_t *tile_amax = malloc((size_t)ntc * 4);
    float *tile_scale = malloc((size_t)ntc * 4);
    uint32_t *work = malloc((size_t)j->cols * 4);
    for (int64_t band = lo; band < hi; band++) {
        const int64_t b = band / ntr, r0 = (band % ntr) * j->tile_r;
        const int64_t r1 = r0 + j->tile_r < j->rows ? r0 + j->tile_r : j->rows;
        if (j->p->rule != RULE_GIVEN || j->amax_out) rows_amax(j, b, r0, r1, tile_amax, work);
        tile_row_scales(j, band, tile_amax, tile_scale);
        if (j->data) cast_rows(j, b, r0, r1, tile_scale, (float *)work);
    }
    free(tile_amax); free(tile_scale); free(work);
    return NULL;
}

/* One tile row (per tensor, per column): the threads split its rows for the amax (phase 0), the scales are
 * made from the combined amaxes, then the threads split the rows again for the cast (phase 1). */
static void *single_band_worker(void *arg) {
    worker_t *w = (worker_t *)arg;
    job_t *j = w->job;
    const int64_t ntc = (j->cols + j->tile_c - 1) / j->tile_c;
    const int64_t lo = j->rows * w->id / j->nthreads, hi = j->rows * (w->id + 1) / j->nthreads;
    uint32_t *work = malloc((size_t)j->cols * 4);
    if (j->phase == 0) {
        uint32_t *mine = j->partial_amax + (size_t)w->id * ntc;
        if (hi > lo) rows_amax(j, 0, lo, hi, mine, work);
        else memset(mine, 0, (size_t)ntc * 4);
    } else if (j->phase == 2) {
        /* a given scale and its amax wanted (delayed scaling): each slab of rows is reduced and then cast while
         * it is still in L1, so the tensor is read from memory once */
        uint32_t *mine = j->partial_amax + (size_t)w->id * ntc, *slab = malloc((size_t)ntc * 4);
        const int64_t slab_rows = 1 + (16384 / (j->x_bf16 ? 2 : 4)) / j->cols; /* about 16 KB of x */
        memset(mine, 0, (size_t)ntc * 4);
        for (int64_t r = lo; r < hi; r += slab_rows) {
            const int64_t r1 = r + slab_rows < hi ? r + slab_rows : hi;
            rows_amax(j, 0, r, r1, slab, work);
            for (int64_t t = 0; t < ntc; t++) mine[t] = slab[t] > mine[t] ? slab[t] : mine[t];
            cast_rows(j, 0, r, r1, j->band_scale, (float *)work);
        }
        free(slab);
    } else if (hi > lo) {
        /* forward, as the prefetch in cast_segment expects (backward, or the rows the amax pass read last
         * first, to reuse the last-level cache: no gain or 20-30% slower on a 2-core EPYC) */
        cast_rows(j, 0, lo, hi, j->band_scale, (float *)work);
    }
    free(work);
    return NULL;
}

static void run_workers(job_t *j, void *(*fn)(void *)) {
    worker_t workers[64];
    for (int32_t i = 0; i < j->nthreads; i++) workers[i] = (worker_t){j, i};
    parallel_run(j->nthreads, fn, workers, sizeof(worker_t));
}


/* The caller's scaling state from the `n` amaxes just written (quantizer.record_amax's torch ops, in the same
 * call): `nonfinite_count` + 1 when any amax is NaN or inf (such an amax never becomes a scale), `pending` =
 * max(pending, the largest finite amax, or -1 when none is finite). Either may be NULL. */
static void record_amaxes(const float *amax, int64_t n, int64_t *nonfinite_count, float *pending) {
    int any_nonfinite = 0;
    float largest = -1.0f;
    for (int64_t i = 0; i < n; i++) {
        if (!(amax[i] < INFINITY)) any_nonfinite = 1; /* (amaxes are >= 0 or NaN) */
        else largest = amax[i] > largest ? amax[i] : largest;
    }
    if (nonfinite_count && any_nonfinite) *nonfinite_count += 1;
    if (pending && largest > *pending) *pending = largest;
}

static int quantize_tiles(const fp8_params *p, const void *x, int32_t x_bf16, int64_t batch, int64_t rows,
                          int64_t cols, int64_t tile_r, int64_t tile_c, const float *scale_in, uint8_t *data,
                          float *scale_out, float *amax_out, float *values, uint16_t *values16, int32_t nthreads);

/* Delayed scaling's cast of a tensor that several layers read (a transformer's q/k/v projections): the cast one
 * layer made with its stored scale `cast_scale` is another layer's cast too when that layer's stored `scale` has
 * the same bits (a cast with a given scale reads nothing else of its layer). Then the other layer's state records
 * the cast's amax as its own cast would have (record_amaxes: either pointer may be NULL) and 1 is returned;
 * else 0, and nothing is written. */
int fp8_share_delayed_cast(const float *cast_scale, const float *scale, const float *cast_amax,
                           int64_t *nonfinite_count, float *pending_amax) {
    if (memcmp(cast_scale, scale, sizeof(float)) != 0) return 0;
    record_amaxes(cast_amax, 1, nonfinite_count, pending_amax);
    return 1;
}

/* Quantize (data != NULL) or only reduce to amax (data == NULL, rule RULE_GIVEN, scale_in NULL). With a given
 * scale and amax_out the amax is taken in the cast's own pass over x (delayed scaling: one read of the tensor).
 * With amax_out, `nonfinite_count` and `pending_amax` (each NULL or one value) are updated from the amaxes
 * (record_amaxes). Returns 0, or a negative number on an internal error (the Python side then raises). */
int fp8_quantize(const fp8_params *p, const void *x, int32_t x_bf16, int64_t batch, int64_t rows, int64_t cols,
                 int64_t tile_r, int64_t tile_c, const float *scale_in, uint8_t *data, float *scale_out,
                 float *amax_out, float *values, uint16_t *values16, int64_t *nonfinite_count, float *pending_amax,
                 int32_t nthreads) {
    const int rc = quantize_tiles(p, x, x_bf16, batch, rows, cols, tile_r, tile_c, scale_in, data, scale_out, amax_out,
                                  values, values16, nthreads);
    if (rc == 0 && amax_out && (nonfinite_count || pending_amax))
        record_amaxes(amax_out, batch * ((rows + tile_r - 1) / tile_r) * ((cols + tile_c - 1) / tile_c),
                      nonfinite_count, pending_amax);
    return rc;
}

static int quantize_tiles(const fp8_params *p, const void *x, int32_t x_bf16, int64_t batch, int64_t rows,
                          int64_t cols, int64_t tile_r, int64_t tile_c, const float *scale_in, uint8_t *data,
                          float *scale_out, float *amax_out, float *values, uint16_t *values16, int32_t nthreads) {
    if (rows <= 0 || cols <= 0 || batch <= 0 || tile_r <= 0 || tile_c <= 0) return -100;
    if (values16 && p->dequantize) return -102; /* value * scale is not exact in bf16 */
    job_t j = {p, x, x_bf16, batch, rows, cols, tile_r, tile_c, scale_in, data, scale_out, amax_out, values,
               values16, 1};
    const int64_t numel = batch * rows * cols, ntc = (cols + tile_c - 1) / tile_c;
    const int64_t nbands = batch * ((rows + tile_r - 1) / tile_r);
    if (nbands >= 2 || rows < 2) {
        j.nthreads = thread_count(numel, nbands, nthreads);
        run_workers(&j, band_worker);
        return 0;
    }
    j.nthreads = thread_count(numel, rows, nthreads);
    j.partial_amax = malloc((size_t)j.nthreads * ntc * 4);
    j.band_scale = malloc((size_t)ntc * 4);
    if (!j.partial_amax || !j.band_scale) { free(j.partial_amax); free(j.band_scale); return -101; }
    /* a given scale with its amax wanted: one fused pass (phase 2); else the amax first when the scale needs it
     * (phase 0), then the cast (phase 1) */
    const int fused = p->rule == RULE_GIVEN && amax_out && data;
    if (fused) {
        memset(j.partial_amax, 0, (size_t)ntc * 4);
        tile_row_scales(&j, 0, j.partial_amax, j.band_scale); /* the given scales (the amax is written below) */
        j.phase = 2;
        run_workers(&j, single_band_worker);
    } else if (p->rule != RULE_GIVEN || amax_out) {
        j.phase = 0;
        run_workers(&j, single_band_worker);
    }
    if (fused || p->rule != RULE_GIVEN || amax_out)
        for (int32_t t = 1; t < j.nthreads; t++)
            for (int64_t c = 0; c < ntc; c++) {
                uint32_t v = j.partial_amax[t * ntc + c];
                j.partial_amax[c] = v > j.partial_amax[c] ? v : j.partial_amax[c];
            }
    if (fused) {
        for (int64_t c = 0; c < ntc; c++)
            amax_out[c] = j.partial_amax[c] > 0x7F800000u ? NAN : u2f(j.partial_amax[c]);
    } else {
        tile_row_scales(&j, 0, j.partial_amax, j.band_scale);
        if (data) {
            j.phase = 1;
            run_workers(&j, single_band_worker);
        }
    }
    free(j.partial_amax); free(j.band_scale);
    return 0;
}

/* ---- delayed scaling's update ------------------------------------------------------------------------------
 * nn/delayed_scaling.update_group's tensor ops for n quantizers on the CPU, each reading and writing its own
 * buffers in place (arrays of pointers: no stacking and unbinding of ~200 one-value tensors a step), the same
 * fp32 / float64 operations row by row:
 *   stale += recorded & initialized & step > 0 & (double)step < (double)scale * min_normal   (the old scale)
 *   history = recorded ? [step, history[:-1]] : history
 *   amax = history[0] (most recent) | max(history) | (outlier factor f) second-largest where second > 0 and
 *          largest > second * f (fp32 product), else largest
 *   usable = recorded & amax > 0;  scale, scale_amax = usable ? (rule(amax), amax) : unchanged;  initialized |= usable
 *   rule = min(max(where(amax > 0, (double)amax / (fmt_max * 2^-margin), 1), 2^-126), cap) -> fp32 (inf -> 1):
 *          scaling.scale_rule on float64 divisors (not power-of-two scales: those stay with the torch ops)
 * with `step_amax` the rows' pending amaxes as all ranks reduced them (NULL: one process, each row's own pending
 * amax); each pending amax is set back to -1 after.
 * `initialized_out` receives every row's new flag (what the host mirror reads). */
int fp8_delayed_update(int64_t n, int64_t history_len, const float *step_amax, float *const *pending,
                       float *const *history, float *const *scale, float *const *scale_amax,
                       uint8_t *const *initialized, int64_t *const *stale, const double *fmt_max,
                       const double *min_normal, const double *cap, int32_t margin, int32_t most_recent,
                       float outlier_factor, uint8_t *initialized_out) {
    if (n < 0 || history_len < 1) return -100;
    for (int64_t i = 0; i < n; i++) {
        const float step = step_amax ? step_amax[i] : *pending[i];
        float *h = history[i];
        const int recorded = step >= 0.0f, was_initialized = *initialized[i] != 0;
        if (recorded && was_initialized && step > 0.0f && (double)step < (double)*scale[i] * min_normal[i])
            *stale[i] += 1;
        if (recorded) {
            memmove(h + 1, h, (size_t)(history_len - 1) * sizeof(float));
            h[0] = step;
        }
        float amax = h[0];
        if (!most_recent) {
            float largest = h[0], second = -INFINITY;
            for (int64_t k = 1; k < history_len; k++) {
                if (h[k] > largest) second = largest, largest = h[k];
                else if (h[k] > second) second = h[k];
            }
            amax = largest;
            if (outlier_factor > 0.0f && history_len >= 2 && second > 0.0f && largest > second * outlier_factor)
                amax = second;
        }
        const int usable = recorded && amax > 0.0f;
        if (usable) {
            double s = (double)amax / (fmt_max[i] * ldexp(1.0, -margin)); /* (a power of two: exact) */
            if (isinf(s)) s = 1.0;
            s = s < 0x1p-126 ? 0x1p-126 : s;
            s = s > cap[i] ? cap[i] : s;
            *scale[i] = (float)s;
            *scale_amax[i] = amax;
            *initialized[i] = 1;
        }
        initialized_out[i] = *initialized[i];
        *pending[i] = -1.0f;
    }
    return 0;
}

/* ---- groups of rows, each quantized as its own matrix ------------------------------------------------------ */
/* The rows of one row-major (rows, cols) matrix come in consecutive groups (a mixture-of-experts layer's tokens,
 * sorted by expert), and each group is quantized as if it were a tensor of its own: tiles of tile_r rows (0: the
 * whole group) never cross a group's end. One call and one parallel region for every group, instead of one per
 * group (each waking the threads for a small matrix). A band here is one tile row of one group, in memory rows
 * [r0, r1) of the whole matrix, whose scales are grid row `band` (grid rows of the groups one after the other, in
 * group order; a group without rows has none). Per band it runs what fp8_quantize runs for that tile row of the
 * group's own call (the same amax, scale rule and cast functions), so every byte, scale and amax is that call's. */
typedef struct {
    job_t *job;
    const int64_t *band_r0; /* nbands + 1 entries: band b is rows [band_r0[b], band_r0[b + 1]) */
    int64_t nbands;
    int32_t id;
} group_worker_t;

static void *group_band_worker(void *arg) {
    group_worker_t *w = (group_worker_t *)arg;
    job_t *j = w->job;
    const int64_t ntc = (j->cols + j->tile_c - 1) / j->tile_c, total = w->band_r0[w->nbands];
    /* the bands whose first row falls in this thread's share of the rows (bands differ in length) */
    const int64_t lo_row = total * w->id / j->nthreads, hi_row = total * (w->id + 1) / j->nthreads;
    uint32_t *tile_amax = malloc((size_t)ntc * 4);
    float *tile_scale = malloc((size_t)ntc * 4);
    uint32_t *work = malloc((size_t)j->cols * 4);
    for (int64_t band = 0; band < w->nbands; band++) {
        const int64_t r0 = w->band_r0[band], r1 = w->band_r0[band + 1];
        if (r0 < lo_row || r0 >= hi_row) continue;
        rows_amax(j, 0, r0, r1, tile_amax, work);
        tile_row_scales(j, band, tile_amax, tile_scale);
        cast_rows(j, 0, r0, r1, tile_scale, (float *)work);
    }
    free(tile_amax); free(tile_scale); free(work);
    return NULL;
}

/* Quantize each of `ngroups` consecutive row groups (group_rows[g] rows each, 0 allowed) with its own amax-rule
 * or MX scales (no given scale), tiles of tile_r rows (0: one tile row per group) and tile_c columns. data,
 * values, values16: (rows, cols) as x; scale_out and amax_out: (grid rows, ntc), grid rows as above. Returns 0,
 * or a negative number on an internal error. */
int fp8_quantize_groups(const fp8_params *p, const void *x, int32_t x_bf16, int64_t ngroups,
                        const int64_t *group_rows, int64_t cols, int64_t tile_r, int64_t tile_c, uint8_t *data,
                        float *scale_out, float *amax_out, float *values, uint16_t *values16, int32_t nthreads) {
    if (ngroups <= 0 || cols <= 0 || tile_r < 0 || tile_c <= 0 || p->rule == RULE_GIVEN || !data) return -100;
    if (values16 && p->dequantize) return -102;
    int64_t rows = 0, nbands = 0;
    for (int64_t g = 0; g < ngroups; g++) {
        if (group_rows[g] < 0) return -100;
        rows += group_rows[g];
        nbands += group_rows[g] == 0 ? 0 : tile_r == 0 ? 1 : (group_rows[g] + tile_r - 1) / tile_r;
    }
    if (rows == 0) return 0;
    int64_t *band_r0 = malloc((size_t)(nbands + 1) * 8);
    if (!band_r0) return -101;
    int64_t band = 0, start = 0;
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t step = tile_r == 0 ? group_rows[g] : tile_r;
        for (int64_t r = start; r < start + group_rows[g]; r += step) band_r0[band++] = r;
        start += group_rows[g];
    }
    band_r0[nbands] = rows;
    job_t j = {p, x, x_bf16, 1, rows, cols, tile_r ? tile_r : rows, tile_c, NULL, data, scale_out, amax_out,
               values, values16, 1};
    j.nthreads = thread_count(rows * cols, nbands, nthreads);
    group_worker_t workers[64];
    for (int32_t i = 0; i < j.nthreads; i++) workers[i] = (group_worker_t){&j, band_r0, nbands, i};
    parallel_run(j.nthreads, group_band_worker, workers, sizeof(group_worker_t));
    free(band_r0);
    return 0;
}

/* ---- decode --------------------------------------------------------------------------------------------- */
typedef struct {
    const float *lut;
    const uint8_t *codes;
    void *out;
    int32_t bf16;
    int64_t n;
    int32_t nthreads, id;
} decode_job;

static void *decode_worker(void *arg) {
    decode_job *d = (decode_job *)arg;
    const int64_t lo = d->n * d->id / d->nthreads, hi = d->n * (d->id + 1) / d->nthreads;
    const float *lut = d->lut;
    if (d->bf16) { /* FP8 values are exact in bf16: the top half of their fp32 bits */
        uint16_t lut16[256];
        for (int i = 0; i < 256; i++) /* NaN: torch's canonical bf16 NaN (FNUZ's 0x7F800001 would truncate to inf) */
            lut16[i] = isnan(lut[i]) ? (uint16_t)0x7FC0 : (uint16_t)(f2u(lut[i]) >> 16);
        uint16_t *o = (uint16_t *)d->out;
        for (int64_t i = lo; i < hi; i++) o[i] = lut16[d->codes[i]];
    } else {
        float *o = (float *)d->out;
        for (int64_t i = lo; i < hi; i++) o[i] = lut[d->codes[i]];
    }
    return NULL;
}

int fp8_decode(const float *lut, const uint8_t *codes, int64_t n, void *out, int32_t out_bf16, int32_t nthreads) {
    decode_job jobs[64];
    nthreads = thread_count(n, n, nthreads);
    for (int32_t i = 0; i < nthreads; i++) jobs[i] = (decode_job){lut, codes, out, out_bf16, n, nthreads, i};
    parallel_run(nthreads, decode_worker, jobs, sizeof(decode_job));
    return 0;
}

/* ---- dequantize: FP8 bytes and their tile scales -> value * scale in fp32 ------------------------------ */
typedef struct {
    const float *lut, *scale;
    const uint8_t *codes;
    float *out;
    int64_t batch, rows, cols, tile_r, tile_c;
    int32_t nthreads, id;
} dequant_job;

static void *dequant_worker(void *arg) {
    dequant_job *d = (dequant_job *)arg;
    const int64_t total = d->batch * d->rows, ntc = (d->cols + d->tile_c - 1) / d->tile_c;
    const int64_t ntr = (d->rows + d->tile_r - 1) / d->tile_r;
    const int64_t lo = total * d->id / d->nthreads, hi = total * (d->id + 1) / d->nthreads;
    float *col_scale = malloc((size_t)d->cols * 4);
    int64_t expanded_row = -1;
    for (int64_t g = lo; g < hi; g++) { /* g: a row of the (batch * rows, cols) matrix */
        const int64_t b = g / d->rows, grid_row = b * ntr + (g % d->rows) / d->tile_r;
        const float *scales = d->scale + grid_row * ntc;
        const uint8_t *c = d->codes + g * d->cols;
        float *o = d->out + g * d->cols;
        if (grid_row != expanded_row) { /* one scale per column, remade when the tile row changes */
            for (int64_t col = 0; col < d->cols; col++) col_scale[col] = scales[col / d->tile_c];
            expanded_row = grid_row;
        }
        for (int64_t col = 0; col < d->cols; col++) o[col] = d->lut[c[col]] * col_scale[col];
    }
    free(col_scale);
    return NULL;
}

int fp8_dequantize(const float *lut, const uint8_t *codes, int64_t batch, int64_t rows, int64_t cols, int64_t tile_r,
                   int64_t tile_c, const float *scale, float *out, int32_t nthreads) {
    if (rows <= 0 || cols <= 0 || batch <= 0 || tile_r <= 0 || tile_c <= 0) return -100;
    dequant_job jobs[64];
    nthreads = thread_count(batch * rows * cols, batch * rows, nthreads);
    for (int32_t i = 0; i < nthreads; i++)
        jobs[i] = (dequant_job){lut, scale, codes, out, batch, rows, cols, tile_r, tile_c, nthreads, i};
    parallel_run(nthreads, dequant_worker, jobs, sizeof(dequant_job));
    return 0;
}

/* ---- the emulated GEMM's epilogue: bf16 accumulator -> * row scale -> * column scale -> + bias -> out ------
 * One pass for what torch does in four (acc.float(), out.mul_(scale_a), out.mul_(scale_b), out.add_(bias),
 * out.to(bf16)): the same fp32 operations in the same order, each rounded once (the library is built with
 * -ffp-contract=off, so no product is fused into the bias add), and torch's fp32 -> bf16 rounding: to nearest
 * even on the bits, every NaN 0xFFFF. scale_a: NULL, one value (a_step 0) or one per row; scale_b: NULL, one
 * value (b_step 0) or one per column; bias: NULL or one per column. */
typedef struct {
    const uint16_t *acc;
    int64_t rows, cols;
    const float *scale_a, *scale_b, *bias;
    int64_t a_step, b_step;
    void *out;
    int32_t out_bf16, nthreads, id;
} epilogue_job;

/* One run of n elements of one row (or, with one scale each and no bias, of the whole matrix as one row), fused
 * into one loop that gcc vectorizes: the same fp32 operations in the same order as the torch ops (acc widened
 * exactly, * row scale, * column scale, + bias, each rounded to fp32; then rounded once to the output). The
 * flags are compile-time constants at each call (one specialized loop per case); `b` is `sb_col[i]` per column
 * or the one value `sb`. */
static inline __attribute__((always_inline)) void epilogue_run(const uint16_t *a, int64_t n, float sa, float sb,
                                                                const float *sb_col, const float *bias, void *out,
                                                                const int out_bf16, const int has_a,
                                                                const int has_b, const int b_col) {
    uint16_t *o16 = (uint16_t *)out;
    float *o32 = (float *)out;
    for (int64_t i = 0; i < n; i++) {
        float v = u2f((uint32_t)a[i] << 16);
        if (has_a) v = v * sa;
        if (has_b) v = v * (b_col ? sb_col[i] : sb);
        if (bias) v = v + bias[i];
        if (out_bf16) o16[i] = f32_to_bf16(v);
        else o32[i] = v;
    }
}

static void epilogue_span(const epilogue_job *d, int64_t offset, int64_t n, float sa, const float *bias) {
    const uint16_t *a = d->acc + offset;
    void *out = d->out_bf16 ? (void *)((uint16_t *)d->out + offset) : (void *)((float *)d->out + offset);
    const int has_a = d->scale_a != NULL, has_b = d->scale_b != NULL, b_col = has_b && d->b_step != 0;
    const float sb = has_b ? d->scale_b[0] : 1.0f, *sb_col = d->scale_b;

#define RUN(BF16, A, B, COL) epilogue_run(a, n, sa, sb, sb_col, bias, out, BF16, A, B, COL)
#define RUN_B(BF16, A) (b_col ? RUN(BF16, A, 1, 1) : has_b ? RUN(BF16, A, 1, 0) : RUN(BF16, A, 0, 0))
    if (d->out_bf16) {
        if (has_a) RUN_B(1, 1);
        else RUN_B(1, 0);
    } else {
        if (has_a) RUN_B(0, 1);
        else RUN_B(0, 0);
    }
#undef RUN_B
#undef RUN
}

static void *epilogue_worker(void *arg) {
    epilogue_job *d = (epilogue_job *)arg;
    if (d->a_step == 0 && d->b_step == 0 && !d->bias) {
        /* one scale each (a tensorwise GEMM) and no bias: the matrix is one run of rows * cols elements (row by
         * row, a 1024x64 output paid a loop set-up per 64 elements: 4x the time of the pass) */
        const int64_t total = d->rows * d->cols;
        const int64_t lo = total * d->id / d->nthreads, hi = total * (d->id + 1) / d->nthreads;
        epilogue_span(d, lo, hi - lo, d->scale_a ? d->scale_a[0] : 1.0f, NULL);
        return NULL;
    }
    const int64_t lo = d->rows * d->id / d->nthreads, hi = d->rows * (d->id + 1) / d->nthreads;
    for (int64_t r = lo; r < hi; r++)
        epilogue_span(d, r * d->cols, d->cols, d->scale_a ? d->scale_a[r * d->a_step] : 1.0f, d->bias);
    return NULL;
}

int fp8_gemm_epilogue(const uint16_t *acc, int64_t rows, int64_t cols, const float *scale_a, int64_t a_step,
                      const float *scale_b, int64_t b_step, const float *bias, void *out, int32_t out_bf16,
                      int32_t nthreads) {
    if (rows <= 0 || cols <= 0) return -100;
    epilogue_job jobs[64];
    nthreads = thread_count(rows * cols, rows, nthreads);
    for (int32_t i = 0; i < nthreads; i++)
        jobs[i] = (epilogue_job){acc, rows, cols, scale_a, scale_b, bias, a_step, b_step, out, out_bf16, nthreads, i};
    parallel_run(nthreads, epilogue_worker, jobs, sizeof(epilogue_job));
    return 0;
}

/* The ABI version the Python side checks before using this library. */
int fp8_abi_version(void) { return 10; }
int fp8_params_size(void) { return (int)sizeof(fp8_params); }

/* Whether the threads are the process's OpenMP runtime's (built with -fopenmp) or pthreads of its own. */
#ifdef _OPENMP
int fp8_uses_openmp(void) { return 1; }
#else
int fp8_uses_openmp(void) { return 0; }
#endif
