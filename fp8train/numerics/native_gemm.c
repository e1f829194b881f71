/* fp8train's bf16 x bf16 -> fp32 GEMM for the emulated FP8 GEMMs on CPU.
 *
 * Why it exists: an emulated FP8 GEMM multiplies FP8 values, which bf16 holds exactly, and the product of two
 * FP8 values is exact in fp32; what a GPU's FP8 GEMM then does is sum those products in fp32 and write fp32
 * (the weight gradient for fp32 master weights) or round once. torch 2.13 has no CPU GEMM that reads bf16 and
 * writes fp32 (aten::mm.dtype is CUDA-only), so the emulation ran those GEMMs in fp32: 4x slower than bf16 on a
 * CPU with AVX512-BF16. This kernel reads bf16, multiplies exactly and sums in fp32 (VDPBF16PS), and writes fp32:
 * the fp32 GEMM's arithmetic on the same values, in another summation order.
 *
 * c (m, n) fp32, row-major, = a (m, k) @ b (k, n); a and b bf16, or FP8 bytes with a table of their bf16 values
 * (a_lut / b_lut: 256 bf16 bit patterns; FP8 values are exact in bf16), with any strides (in elements). Packing
 * reads the bytes through the table, so an FP8 operand is never decoded to a bf16 copy in memory. The order of
 * the sums, for one c[i, j] (every step an fp32 operation rounded to nearest even):
 *   - k is walked in cache blocks of 2 * KC_PAIRS (with scales: the largest multiple of k_block up to that, or
 *     one k_block), each summed from zero; c = that sum for the first cache block, then c = c + that sum;
 *   - within a cache block, in K blocks (without scales one K block spans it): s = 0, and for each k pair
 *     (2q, 2q + 1): s = s + a[i, 2q+1] * b[2q+1, j], then s = s + a[i, 2q] * b[2q, j] (VDPBF16PS's order in
 *     the Intel SDM; an odd k's missing partner is 0); with K-block scales, the cache block's sum t = t + (s *
 *     kscale_a[i, block]) * kscale_b[block, j], in block order from t = 0; without, t = s;
 *   - then the epilogue on the whole sum: times the row's scale, times the column's scale, plus the column's bias
 *     (each optional, each an fp32 operation), and rounded to bf16 (torch's rounding) where the output is bf16.
 * Per-K-block scales serve the block and MX recipes, whose scales vary along K: what a GPU's blockwise-scaled
 * FP8 GEMM does (DeepSeek-V3's promotion of each 128-long partial sum).
 * VDPBF16PS reads bf16 inputs below 2^-126 as zero and flushes such results: the callers pass FP8 values (at
 * least 2^-16 in magnitude unless zero; products at least 2^-32) and apply scales to fp32 partial sums only.
 *
 * Layout of the work: b is packed per panel of NR columns as k pairs (one 512-bit register = 16 columns x 2 k),
 * a per panel of MR rows, and an MR x NR register tile sums a cache block, each k pair of a row one 32-bit
 * broadcast. a's panel keeps a's rows where k is contiguous in a (a copy or a decode per row, no transpose: for
 * a GEMM with a short K and many rows, such as grad_input, packing by pairs cost about a third of its time), and
 * is laid out by k pairs where a's rows are contiguous (a transposed operand). Neither changes the sums.
 * Threads split the larger of m and n into ranges of panels (no shared writes, no barrier). The same loops also run in plain C
 * (one product and one addition at a time, the same order): on CPUs without AVX512-BF16, and on request
 * anywhere (`plain`), so every CPU runs the packing and the edges, and the two loops can be compared. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define GEMM_VECTOR 1
#else
#define GEMM_VECTOR 0
#endif

#define MR 12        /* rows of a register tile: 12 x 2 accumulators + 2 b registers of 32 */
#define NR 32        /* columns of a register tile: two 16-lane fp32 registers */
#define KC_PAIRS 1024 /* k-pairs per cache block: a K up to 2048 is summed in registers in one go (c written
                        * once); b's panel 1024 x 128 B = 128 KB and a's 48 KB stream from L2 */
#define MC_PANELS 5    /* row panels of a packed at once: 60 rows x 2048 k x 2 B = 240 KB, held in L2 */
#define LDA_ROWS (2 * KC_PAIRS + 32) /* a's packed row stride (bf16) when its rows are packed as rows: 4160 B, so
                                      * the MR rows' lines fall in different L1 sets (a 4096 B stride would put all
                                      * twelve in one 8-way set) */

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Packing: a run of `width` (MR rows of a, or NR columns of b) by 2 * pairs k values -> packed[pair][w][2],
 * zeros past k and past the run's `valid` width (zeros add nothing). `sw`: the stride along the width, `sk`
 * along k, in elements. Two memory layouts are common and get loops without per-element index arithmetic:
 * k contiguous (sk == 1: each pair is one 32-bit word) and the width contiguous (sw == 1: two runs of k,
 * interleaved). FP8 bytes go through their table here: about as fast as copying bf16, and it saves writing and
 * reading back a decoded copy of the operand. */
/* element i of a run: a bf16 (lut NULL) or an FP8 byte read through the table; `lut` is a constant NULL or not in
 * each specialization of pack_run_as below, so the test folds away */
static inline __attribute__((always_inline)) uint16_t element(const void *x, int64_t i, const uint16_t *lut) {
    return lut ? lut[((const uint8_t *)x)[i]] : ((const uint16_t *)x)[i];
}

/* bf16 elements i and i + 1 (k and k + 1) as one word, low half first (little-endian: packed[w][0] = k) */
static inline uint32_t load_pair(const uint16_t *x, int64_t i) {
    uint32_t v;
    memcpy(&v, x + i, 4);
    return v;
}

/* FP8 bytes -> bf16 through the table, for runs of them: with AVX512-BW 32 at a time (the 256-entry table in
 * eight registers, four two-register word permutes, then bits 6 and 7 of the code pick among them), one at a
 * time elsewhere. */
#if GEMM_VECTOR && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DECODE_VECTOR 1
typedef struct { __m512i t[8]; } fp8_table;

static inline __attribute__((always_inline)) fp8_table table_of(const uint16_t *lut) {
    fp8_table v;
    for (int q = 0; q < 8; q++) v.t[q] = _mm512_loadu_si512(lut + 32 * q);
    return v;
}

static inline __attribute__((always_inline)) __m512i decode32(const fp8_table *v, __m256i bytes) {
    const __m512i idx = _mm512_cvtepu8_epi16(bytes);
    const __m512i r0 = _mm512_permutex2var_epi16(v->t[0], idx, v->t[1]); /* codes 0..63 (low 6 bits) */
    const __m512i r1 = _mm512_permutex2var_epi16(v->t[2], idx, v->t[3]); /* 64..127 */
    const __m512i r2 = _mm512_permutex2var_epi16(v->t[4], idx, v->t[5]); /* 128..191 */
    const __m512i r3 = _mm512_permutex2var_epi16(v->t[6], idx, v->t[7]); /* 192..255 */
    const __mmask32 bit6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(64));
    const __mmask32 bit7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(128));
    return _mm512_mask_blend_epi16(bit7, _mm512_mask_blend_epi16(bit6, r0, r1), _mm512_mask_blend_epi16(bit6, r2, r3));
}

static inline __attribute__((always_inline)) void decode_run(const fp8_table *v, const uint8_t *src, int64_t n,
                                                             uint16_t *dst) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512(dst + i, decode32(v, _mm256_loadu_si256((const __m256i *)(src + i))));
    if (i < n) { /* the last n - i (< 32): masked, no read or write past the run */
        const __mmask32 mask = (__mmask32)((1ull << (n - i)) - 1);
        _mm512_mask_storeu_epi16(dst + i, mask, decode32(v, _mm256_maskz_loadu_epi8(mask, src + i)));
    }
}
#else
#define DECODE_VECTOR 0
typedef struct { const uint16_t *lut; } fp8_table;

static inline fp8_table table_of(const uint16_t *lut) { return (fp8_table){lut}; }

static inline void decode_run(const fp8_table *v, const uint8_t *src, int64_t n, uint16_t *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = v->lut[src[i]];
}
#endif

/* k contiguous FP8 bytes: each row's run decoded, then laid out in pairs as the bf16 loop does */
static void pack_fp8_rows(const uint8_t *x, int64_t sw, int width, int64_t k0, int64_t full, uint16_t *packed,
                          const uint16_t *lut) {
    const fp8_table table = table_of(lut);
    uint16_t run[2 * KC_PAIRS];
    uint32_t *dst = (uint32_t *)packed;
    for (int w = 0; w < width; w++) {
        decode_run(&table, x + w * sw + k0, 2 * full, run);
        for (int64_t p = 0; p < full; p++) {
            uint32_t pair;
            memcpy(&pair, run + 2 * p, 4);
            dst[p * width + w] = pair;
        }
    }
}

#if DECODE_VECTOR
/* the width contiguous (a run of `width` <= 32 bytes per k): the runs of k and k + 1 decoded together and
 * interleaved into pairs by a word permute */
static void pack_fp8_columns(const uint8_t *x, int64_t sk, int width, int64_t k0, int64_t full, uint16_t *packed,
                             const uint16_t *lut) {
    const fp8_table table = table_of(lut);
    uint16_t even_first[32], even_last[32], narrow[32];
    for (int j = 0; j < 32; j++) { /* output word j: k's value (j even) or k + 1's (j odd) of column j / 2 */
        even_first[j] = (uint16_t)(j / 2 + (j % 2 ? 32 : 0));
        even_last[j] = (uint16_t)(16 + j / 2 + (j % 2 ? 32 : 0));
        narrow[j] = (uint16_t)(j / 2 + (j % 2 ? 16 : 0)); /* k's run in words 0..15, k + 1's in 16..31 */
    }
    const __m512i first = _mm512_loadu_si512(even_first), last = _mm512_loadu_si512(even_last);
    const __m512i interleave = _mm512_loadu_si512(narrow);
    const __mmask16 in_mask = (__mmask16)((1u << (width < 16 ? width : 16)) - 1);
    const __mmask32 out_mask = (__mmask32)((1ull << (2 * (width < 16 ? width : 16))) - 1);
    for (int64_t p = 0; p < full; p++) {
        const uint8_t *ra = x + (k0 + 2 * p) * sk, *rb = ra + sk;
        uint16_t *dst = packed + p * width * 2;
        if (width == 32) {
            const __m512i lo = decode32(&table, _mm256_loadu_si256((const __m256i *)ra));
            const __m512i hi = decode32(&table, _mm256_loadu_si256((const __m256i *)rb));
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(lo, first, hi));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(lo, last, hi));
        } else {
            const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_maskz_loadu_epi8(in_mask, ra)),
                                                         _mm_maskz_loadu_epi8(in_mask, rb), 1);
            _mm512_mask_storeu_epi16(dst, out_mask, _mm512_permutexvar_epi16(interleave, decode32(&table, both)));
        }
    }
}
#endif

static inline __attribute__((always_inline)) void pack_run_as(const void *x, int64_t sw, int64_t sk, int64_t k,
                                                              int64_t valid, int width, int64_t k0, int64_t pairs,
                                                              uint16_t *packed, const uint16_t *lut) {
    const int64_t full = (k - k0) / 2 < pairs ? ((k - k0) > 0 ? (k - k0) / 2 : 0) : pairs; /* pairs inside k */
    if (lut && valid == width && sk == 1) {
        pack_fp8_rows((const uint8_t *)x, sw, width, k0, full, packed, lut);
#if DECODE_VECTOR
    } else if (lut && valid == width && sw == 1 && (width == 32 || width <= 16)) {
        pack_fp8_columns((const uint8_t *)x, sk, width, k0, full, packed, lut);
#endif
    } else if (!lut && valid == width && sk == 1) {
        uint32_t *dst = (uint32_t *)packed;
        for (int w = 0; w < width; w++) {
            const int64_t row = w * sw + k0;
            for (int64_t p = 0; p < full; p++) dst[p * width + w] = load_pair((const uint16_t *)x, row + 2 * p);
        }
    } else if (valid == width && sw == 1) {
        for (int64_t p = 0; p < full; p++) {
            const int64_t ra = (k0 + 2 * p) * sk, rb = ra + sk;
            uint16_t *dst = packed + p * width * 2;
            for (int w = 0; w < width; w++) {
                dst[2 * w] = element(x, ra + w, lut);
                dst[2 * w + 1] = element(x, rb + w, lut);
            }
        }
    } else {
        for (int64_t p = 0; p < full; p++) {
            uint16_t *dst = packed + p * width * 2;
            const int64_t ra = (k0 + 2 * p) * sk, rb = ra + sk;
            for (int64_t w = 0; w < valid; w++) {
                dst[2 * w] = element(x, ra + w * sw, lut);
                dst[2 * w + 1] = element(x, rb + w * sw, lut);
            }
            for (int64_t w = valid; w < width; w++) dst[2 * w] = dst[2 * w + 1] = 0;
        }
    }
    for (int64_t p = full; p < pairs; p++) { /* the last pairs: past k, or an odd k's last one */
        uint16_t *dst = packed + p * width * 2;
        const int64_t ka = k0 + 2 * p, kb = ka + 1;
        for (int64_t w = 0; w < width; w++) {
            dst[2 * w] = w < valid && ka < k ? element(x, w * sw + ka * sk, lut) : 0;
            dst[2 * w + 1] = w < valid && kb < k ? element(x, w * sw + kb * sk, lut) : 0;
        }
    }
}

/* x points at the run's first element */
static void pack_run(const void *x, int64_t sw, int64_t sk, int64_t k, int64_t valid, int width, int64_t k0,
                     int64_t pairs, uint16_t *packed, const uint16_t *lut) {
    if (lut) pack_run_as(x, sw, sk, k, valid, width, k0, pairs, packed, lut);
    else pack_run_as(x, sw, sk, k, valid, width, k0, pairs, packed, NULL);
}

/* x advanced by `offset` elements of its kind (2-byte bf16 or 1-byte FP8) */
static inline const void *advance(const void *x, int64_t offset, const uint16_t *lut) {
    return lut ? (const void *)((const uint8_t *)x + offset) : (const void *)((const uint16_t *)x + offset);
}

/* b[k0:k0+2*pairs, n0:n0+NR] -> packed[pair][column][2] */
static void pack_b(const void *b, const uint16_t *lut, int64_t k, int64_t n, int64_t sbk, int64_t sbn, int64_t k0,
                   int64_t pairs, int64_t n0, uint16_t *packed) {
    pack_run(advance(b, n0 * sbn, lut), sbn, sbk, k, n - n0 < NR ? n - n0 : NR, NR, k0, pairs, packed, lut);
}

/* a[m0:m0+MR, k0:k0+2*pairs] -> packed[pair][row][2] */
static void pack_a(const void *a, const uint16_t *lut, int64_t m, int64_t k, int64_t sam, int64_t sak, int64_t m0,
                   int64_t k0, int64_t pairs, uint16_t *packed) {
    pack_run(advance(a, m0 * sam, lut), sam, sak, k, m - m0 < MR ? m - m0 : MR, MR, k0, pairs, packed, lut);
}

/* Whether a's panels are packed as rows (packed[row][k], row stride LDA_ROWS): where k is contiguous in a (each row
 * a copy, or a decode of its FP8 bytes; no transpose) and a cache block's k fits a row. Else as pairs (above). */
static inline int a_packed_as_rows(int64_t sak, int64_t kc_pairs) { return sak == 1 && kc_pairs <= KC_PAIRS; }

/* a[m0:m0+MR, k0:k0+2*pairs] -> packed[row][k] (row stride LDA_ROWS), zeros past k and past m */
static void pack_a_rows(const void *a, const uint16_t *lut, int64_t m, int64_t k, int64_t sam, int64_t m0, int64_t k0,
                        int64_t pairs, uint16_t *packed) {
    const int64_t inside = k - k0 < 2 * pairs ? (k - k0 > 0 ? k - k0 : 0) : 2 * pairs; /* k values inside k */
    const int64_t valid = m - m0 < MR ? m - m0 : MR;
    if (lut) {
        const fp8_table table = table_of(lut);
        for (int64_t w = 0; w < valid; w++)
            decode_run(&table, (const uint8_t *)a + (m0 + w) * sam + k0, inside, packed + w * LDA_ROWS);
    } else {
        for (int64_t w = 0; w < valid; w++)
            memcpy(packed + w * LDA_ROWS, (const uint16_t *)a + (m0 + w) * sam + k0, (size_t)inside * 2);
    }
    for (int64_t w = 0; w < MR; w++) /* zeros after each row's values, and whole rows past m */
        for (int64_t q = w < valid ? inside : 0; q < 2 * pairs; q++) packed[w * LDA_ROWS + q] = 0;
}

/* the a word (k pair p, row i) of a packed panel: rows layout packed[row][k], else pairs layout packed[pair][row][2] */
#define A_PAIR(pa, p, i, rows) (((const uint32_t *)(pa))[(rows) ? (i) * (LDA_ROWS / 2) + (p) : (p) * MR + (i)])

/* tile[MR][NR] = the packed pairs' sum, in K blocks of `block_pairs` pairs: with scales (sa[b * MR + i] per row,
 * sb[b * NR + j] per column of block b) each block's fresh fp32 sum is multiplied by its row's scale, then by its
 * column's, and added to the tile; without (sa NULL) one fp32 sum over all pairs. */
#if GEMM_VECTOR
/* With `epi` (an fp32 result, the last cache block of a whole tile), the epilogue runs on the registers before the
 * store: times the row's scale, times the column's, plus the column's bias, each an fp32 operation in the order of
 * the scalar epilogue in gemm_worker (the same bits), so a GEMM with a short K does not pay a scalar pass per
 * element. */
typedef struct {
    const float *scale_a, *scale_b, *bias; /* at this tile's first row / column (NULL: none) */
    int64_t a_step, b_step;                /* 0: one value; 1: one per row / column */
} tile_epilogue;

static inline __attribute__((always_inline)) void tile_sum_vector_as(
        const uint16_t *pa, const uint16_t *pb, int64_t pairs, int64_t block_pairs, const float *sa, const float *sb,
        float *tile, int64_t ld, int add, const tile_epilogue *epi, const int rows, const int kscaled) {
    __m512 out[MR][2];
    if (kscaled) for (int i = 0; i < MR; i++) out[i][0] = out[i][1] = _mm512_setzero_ps();
    for (int64_t p0 = 0, b = 0; p0 < pairs; p0 += block_pairs, b++) {
        const int64_t p1 = kscaled && p0 + block_pairs < pairs ? p0 + block_pairs : pairs;
        __m512 acc[MR][2];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t p = p0; p < p1; p++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pb + p * NR * 2);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pb + p * NR * 2 + 32);
            for (int i = 0; i < MR; i++) {
                const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)A_PAIR(pa, p, i, rows));
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
            }
        }
        if (kscaled) {
            const __m512 sb0 = _mm512_loadu_ps(sb + b * NR), sb1 = _mm512_loadu_ps(sb + b * NR + 16);
            for (int i = 0; i < MR; i++) {
                const __m512 s = _mm512_set1_ps(sa[b * MR + i]);
                out[i][0] = _mm512_add_ps(out[i][0], _mm512_mul_ps(_mm512_mul_ps(acc[i][0], s), sb0));
                out[i][1] = _mm512_add_ps(out[i][1], _mm512_mul_ps(_mm512_mul_ps(acc[i][1], s), sb1));
            }
        } else {
            for (int i = 0; i < MR; i++) out[i][0] = acc[i][0], out[i][1] = acc[i][1];
            break; /* one block spans the pairs */
        }
    }
    __m512 sb_lo = _mm512_setzero_ps(), sb_hi = sb_lo, bias_lo = sb_lo, bias_hi = sb_lo;
    if (epi && epi->scale_b) {
        sb_lo = epi->b_step ? _mm512_loadu_ps(epi->scale_b) : _mm512_set1_ps(epi->scale_b[0]);
        sb_hi = epi->b_step ? _mm512_loadu_ps(epi->scale_b + 16) : sb_lo;
    }
    if (epi && epi->bias) bias_lo = _mm512_loadu_ps(epi->bias), bias_hi = _mm512_loadu_ps(epi->bias + 16);
    for (int i = 0; i < MR; i++) { /* tile: ld floats per row; add: tile = tile + out (c + t), else tile = out */
        float *row = tile + i * ld;
        if (add) {
            out[i][0] = _mm512_add_ps(_mm512_loadu_ps(row), out[i][0]);
            out[i][1] = _mm512_add_ps(_mm512_loadu_ps(row + 16), out[i][1]);
        }
        if (epi) {
            if (epi->scale_a) {
                const __m512 s = _mm512_set1_ps(epi->scale_a[i * epi->a_step]);
                out[i][0] = _mm512_mul_ps(out[i][0], s);
                out[i][1] = _mm512_mul_ps(out[i][1], s);
            }
            if (epi->scale_b) out[i][0] = _mm512_mul_ps(out[i][0], sb_lo), out[i][1] = _mm512_mul_ps(out[i][1], sb_hi);
            if (epi->bias) out[i][0] = _mm512_add_ps(out[i][0], bias_lo), out[i][1] = _mm512_add_ps(out[i][1], bias_hi);
        }
        _mm512_storeu_ps(row, out[i][0]);
        _mm512_storeu_ps(row + 16, out[i][1]);
    }
}

/* one specialization per a layout and per K-block scales (their absence leaves no second set of registers) */
static void tile_sum_vector(const uint16_t *pa, const uint16_t *pb, int64_t pairs, int64_t block_pairs, const float *sa,
                            const float *sb, float *tile, int64_t ld, int add, const tile_epilogue *epi, int rows) {
    if (rows) {
        if (sa) tile_sum_vector_as(pa, pb, pairs, block_pairs, sa, sb, tile, ld, add, epi, 1, 1);
        else tile_sum_vector_as(pa, pb, pairs, block_pairs, sa, sb, tile, ld, add, epi, 1, 0);
    } else {
        if (sa) tile_sum_vector_as(pa, pb, pairs, block_pairs, sa, sb, tile, ld, add, epi, 0, 1);
        else tile_sum_vector_as(pa, pb, pairs, block_pairs, sa, sb, tile, ld, add, epi, 0, 0);
    }
}
#endif

/* the same sums one product and one addition at a time: any CPU (and a reference for the vector loop) */
static void tile_sum_plain(const uint16_t *pa, const uint16_t *pb, int64_t pairs, int64_t block_pairs, const float *sa,
                           const float *sb, float *tile, int rows) {
    float acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) tile[i] = 0.0f;
    for (int64_t p0 = 0, b = 0; p0 < pairs; p0 += block_pairs, b++) {
        const int64_t p1 = p0 + block_pairs < pairs ? p0 + block_pairs : pairs;
        for (int i = 0; i < MR * NR; i++) acc[i] = 0.0f;
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *bp = pb + p * NR * 2;
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < NR; j++) {
                    const uint32_t ap = A_PAIR(pa, p, i, rows); /* k even in the low half, k + 1 in the high */
                    /* the odd k first, then the even one: VDPBF16PS's order (Intel SDM) */
                    acc[i * NR + j] += bf16_to_f32((uint16_t)(ap >> 16)) * bf16_to_f32(bp[2 * j + 1]);
                    acc[i * NR + j] += bf16_to_f32((uint16_t)ap) * bf16_to_f32(bp[2 * j]);
                }
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++)
                tile[i * NR + j] = sa ? tile[i * NR + j] + (acc[i * NR + j] * sa[b * MR + i]) * sb[b * NR + j]
                                      : acc[i * NR + j];
    }
}

typedef struct {
    const void *a, *b;
    const uint16_t *a_lut, *b_lut; /* NULL: bf16; else FP8 bytes and their bf16 values */
    int64_t m, n, k, sam, sak, sbk, sbn;
    const float *kscale_a; /* NULL, or (m, k_blocks): row i, K block kb at kscale_a[i * k_blocks + kb] */
    const float *kscale_b; /* NULL, or (k_blocks, n) */
    int64_t k_block, k_blocks;
    const float *scale_a; /* the epilogue's (after the whole sum): NULL, one value (a_step 0) or one per row */
    const float *scale_b; /* NULL, one value (b_step 0) or one per column */
    int64_t a_step, b_step;
    const float *bias; /* NULL or one per column */
    float *c;
    uint16_t *out_bf16; /* NULL: the result is c (fp32); else the result rounded to bf16 here, c a scratch sum */
    int64_t m_lo, m_hi, n_lo, n_hi; /* this thread's row panels and column panels */
    int32_t plain; /* 1: the plain C loop even where the vector one is built */
    int32_t status;
} gemm_job;

static void *gemm_worker(void *arg) {
    gemm_job *j = (gemm_job *)arg;
    /* a cache block holds whole K blocks (with scales; without, one "block" spans it) */
    const int64_t block_pairs = j->kscale_a ? j->k_block / 2 : KC_PAIRS;
    const int64_t kc_pairs = block_pairs >= KC_PAIRS ? block_pairs : KC_PAIRS / block_pairs * block_pairs;
    const int64_t kc_blocks = kc_pairs / block_pairs;
    const int64_t n_panels = j->n_hi - j->n_lo;
    const int64_t total_pairs = (j->k + 1) / 2;
    /* buffers for what this GEMM needs (a small one must not pay for a big one's: no large allocations) */
    const int64_t kc_used = total_pairs < kc_pairs ? (total_pairs + block_pairs - 1) / block_pairs * block_pairs
                                                   : kc_pairs;
    const int64_t mc_used = j->m_hi - j->m_lo < MC_PANELS ? j->m_hi - j->m_lo : MC_PANELS;
    const int a_rows = a_packed_as_rows(j->sak, kc_used); /* a's packed layout */
    const size_t a_panel = a_rows ? (size_t)MR * LDA_ROWS : (size_t)MR * 2 * kc_used, b_panel = (size_t)NR * 2 * kc_used;
    uint16_t *pa = aligned_alloc(64, (size_t)mc_used * a_panel * 2 + 64);
    uint16_t *pb = aligned_alloc(64, (size_t)n_panels * NR * 2 * kc_used * 2 + 64);
    float *tile = aligned_alloc(64, MR * NR * 4);
    float *sa = j->kscale_a ? aligned_alloc(64, (size_t)MC_PANELS * kc_blocks * MR * 4 + 64) : NULL;
    float *sb = j->kscale_a ? aligned_alloc(64, (size_t)n_panels * kc_blocks * NR * 4 + 64) : NULL;
    if (!pa || !pb || !tile || (j->kscale_a && (!sa || !sb))) {
        free(pa); free(pb); free(tile); free(sa); free(sb);
        j->status = -101;
        return NULL;
    }
    const int epilogue = j->scale_a || j->scale_b || j->bias || j->out_bf16;
    for (int64_t p0 = 0; p0 < total_pairs; p0 += kc_pairs) {
        const int64_t pairs = total_pairs - p0 < kc_pairs ? total_pairs - p0 : kc_pairs;
        const int64_t k0 = 2 * p0, kb0 = j->kscale_a ? p0 / block_pairs : 0;
        const int64_t blocks = (pairs + block_pairs - 1) / block_pairs;
        const int last = p0 + kc_pairs >= total_pairs;
        for (int64_t np = 0; np < n_panels; np++) { /* this thread's b panels of the cache block, once */
            const int64_t n0 = (j->n_lo + np) * NR, cols = j->n - n0 < NR ? j->n - n0 : NR;
            pack_b(j->b, j->b_lut, j->k, j->n, j->sbk, j->sbn, k0, pairs, n0, pb + np * b_panel);
            if (sb) /* per block: [block][column], 0 past n */
                for (int64_t b = 0; b < blocks; b++)
                    for (int64_t q = 0; q < NR; q++)
                        sb[(np * kc_blocks + b) * NR + q] = q < cols ? j->kscale_b[(kb0 + b) * j->n + n0 + q] : 0.0f;
        }
        for (int64_t mc = j->m_lo; mc < j->m_hi; mc += MC_PANELS) { /* a's panels, MC_PANELS at a time */
            const int64_t mc_panels = j->m_hi - mc < MC_PANELS ? j->m_hi - mc : MC_PANELS;
            for (int64_t mp = 0; mp < mc_panels; mp++) {
                const int64_t m0 = (mc + mp) * MR;
                if (a_rows) pack_a_rows(j->a, j->a_lut, j->m, j->k, j->sam, m0, k0, pairs, pa + mp * a_panel);
                else pack_a(j->a, j->a_lut, j->m, j->k, j->sam, j->sak, m0, k0, pairs, pa + mp * a_panel);
                if (sa) /* per block: [block][row], 0 past m */
                    for (int64_t b = 0; b < blocks; b++)
                        for (int64_t i = 0; i < MR; i++)
                            sa[(mp * kc_blocks + b) * MR + i] =
                                m0 + i < j->m ? j->kscale_a[(m0 + i) * j->k_blocks + kb0 + b] : 0.0f;
            }
            for (int64_t np = 0; np < n_panels; np++) {
                const int64_t n0 = (j->n_lo + np) * NR, cols = j->n - n0 < NR ? j->n - n0 : NR;
                const float *panel_sb = sb ? sb + np * kc_blocks * NR : NULL;
                for (int64_t mp = 0; mp < mc_panels; mp++) {
                    const int64_t m0 = (mc + mp) * MR, rows = j->m - m0 < MR ? j->m - m0 : MR;
                    const float *panel_sa = sa ? sa + mp * kc_blocks * MR : NULL;
                    const uint16_t *panel_a = pa + mp * a_panel, *panel_b = pb + np * b_panel;
#if GEMM_VECTOR
                    /* straight into c, with the epilogue on the registers for an fp32 result */
                    if (!j->plain && rows == MR && cols == NR && !(last && epilogue && j->out_bf16)) {
                        const tile_epilogue epi = {j->scale_a ? j->scale_a + m0 * j->a_step : NULL,
                                                   j->scale_b ? j->scale_b + n0 * j->b_step : NULL,
                                                   j->bias ? j->bias + n0 : NULL, j->a_step, j->b_step};
                        tile_sum_vector(panel_a, panel_b, pairs, block_pairs, panel_sa, panel_sb,
                                        j->c + m0 * j->n + n0, j->n, p0 != 0, last && epilogue ? &epi : NULL, a_rows);
                        continue;
                    }
                    if (!j->plain)
                        tile_sum_vector(panel_a, panel_b, pairs, block_pairs, panel_sa, panel_sb, tile, NR, 0, NULL, a_rows);
                    else
#endif
                    tile_sum_plain(panel_a, panel_b, pairs, block_pairs, panel_sa, panel_sb, tile, a_rows);
                    for (int64_t i = 0; i < rows; i++) {
                        float *c = j->c + (m0 + i) * j->n + n0;
                        const float *t = tile + i * NR;
                        if (!(last && epilogue)) {
                            if (p0 == 0) memcpy(c, t, (size_t)cols * 4);
                            else for (int64_t q = 0; q < cols; q++) c[q] = c[q] + t[q];
                            continue;
                        }
                        /* the epilogue: the sum, times the row's scale, times the column's, plus the bias, each
                         * rounded in fp32, then to bf16 (torch's rounding) or kept */
                        float v[NR];
                        for (int64_t q = 0; q < cols; q++) v[q] = p0 == 0 ? t[q] : c[q] + t[q];
                        if (j->scale_a) {
                            const float sa_row = j->scale_a[(m0 + i) * j->a_step];
                            for (int64_t q = 0; q < cols; q++) v[q] = v[q] * sa_row;
                        }
                        if (j->scale_b)
                            for (int64_t q = 0; q < cols; q++) v[q] = v[q] * j->scale_b[(n0 + q) * j->b_step];
                        if (j->bias)
                            for (int64_t q = 0; q < cols; q++) v[q] = v[q] + j->bias[n0 + q];
                        if (j->out_bf16) {
                            uint16_t *o = j->out_bf16 + (m0 + i) * j->n + n0;
                            for (int64_t q = 0; q < cols; q++) o[q] = f32_to_bf16(v[q]);
                        } else {
                            memcpy(c, v, (size_t)cols * 4);
                        }
                    }
                }
            }
        }
    }
    free(pa); free(pb); free(tile); free(sa); free(sb);
    return NULL;
}

/* Whether the fast (AVX512-BF16) loop is built in; 0: the plain C loop. */
int fp8_gemm_vectorized(void) { return GEMM_VECTOR; }

/* c = a @ b (see the top of this file; a_lut / b_lut NULL for a bf16 operand, else its FP8 bytes' table), then
 * the epilogue: times scale_a (NULL, one value: a_step 0, or one per
 * row: a_step 1), times scale_b (likewise per column), plus bias (NULL or one per column), each an fp32 operation,
 * and, with out_bf16, rounded to bf16 into out_bf16 (c is then a scratch sum). k_block: 0 (no K-block scales) or
 * the K block of kscale_a (m, K blocks) / kscale_b (K blocks, n), which must then be even and both given. plain:
 * 1 runs the plain C loop where the vector one is built too. Returns 0, or a negative number on an internal
 * error. */
int fp8_gemm_bf16(const void *a, const uint16_t *a_lut, const void *b, const uint16_t *b_lut, int64_t m, int64_t n, int64_t k, int64_t sam, int64_t sak,
                  int64_t sbk, int64_t sbn, const float *kscale_a, const float *kscale_b, int64_t k_block,
                  const float *scale_a, int64_t a_step, const float *scale_b, int64_t b_step, const float *bias,
                  float *c, uint16_t *out_bf16, int32_t plain, int32_t nthreads) {
    if (m <= 0 || n <= 0 || k <= 0) return -100;
    if ((kscale_a == NULL) != (kscale_b == NULL) || (kscale_a && (k_block <= 0 || k_block % 2))) return -102;
    /* threads split the larger of m and n: each packs the other operand whole (the smaller one) */
    const int64_t m_panels = (m + MR - 1) / MR, n_panels = (n + NR - 1) / NR;
    const int split_rows = m > n;
    const int64_t panels = split_rows ? m_panels : n_panels;
    nthreads = thread_count(m * n * (k < 64 ? k : 64), panels, nthreads);
    gemm_job jobs[64];
    for (int32_t i = 0; i < nthreads; i++) {
        const int64_t lo = panels * i / nthreads, hi = panels * (i + 1) / nthreads;
        jobs[i] = (gemm_job){a, b, a_lut, b_lut, m, n, k, sam, sak, sbk, sbn, kscale_a, kscale_b, kscale_a ? k_block : k,
                             kscale_a ? (k + k_block - 1) / k_block : 1, scale_a, scale_b, a_step, b_step, bias,
                             c, out_bf16, split_rows ? lo : 0, split_rows ? hi : m_panels, split_rows ? 0 : lo,
                             split_rows ? n_panels : hi, plain, 0};
    }
    parallel_run(nthreads, gemm_worker, jobs, sizeof(gemm_job));
    for (int32_t i = 0; i < nthreads; i++)
        if (jobs[i].status) return jobs[i].status;
    return 0;
}
