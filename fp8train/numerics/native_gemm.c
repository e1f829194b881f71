/* fp8train's bf16 x bf16 -> fp32 GEMM for the emulated FP8 GEMMs on CPU.
 *
 * Why it exists: an emulated FP8 GEMM multiplies FP8 values, which bf16 holds exactly, and the product of two
 * FP8 values is exact in fp32; what a GPU's FP8 GEMM then does is sum those products in fp32 and write fp32
 * (the weight gradient for fp32 master weights) or round once. torch 2.13 has no CPU GEMM that reads bf16 and
 * writes fp32 (aten::mm.dtype is CUDA-only), so the emulation ran those GEMMs in fp32: 4x slower than bf16 on a
 * CPU with AVX512-BF16. This kernel reads bf16, multiplies exactly and sums in fp32 (VDPBF16PS), and writes fp32:
 * the fp32 GEMM's arithmetic on the same values, in another summation order.
 *
 * c (m, n) fp32, row-major, = a (m, k) @ b (k, n); a and b bf16 with any strides (in elements). The order of
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
 * a per panel of MR rows as k pairs (one 32-bit broadcast), and an MR x NR register tile sums a cache block.
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
#define KC_PAIRS 256 /* k-pairs per cache block: b's panel 256 x 128 B = 32 KB stays in L1 beside a's 12 KB */
#define MC_PANELS 20 /* row panels of a packed at once: 240 rows x 512 k x 2 B = 240 KB, held in L2 */

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Packing: a run of `width` (MR rows of a, or NR columns of b) by 2 * pairs k values -> packed[pair][w][2],
 * zeros past k and past the run's `valid` width (zeros add nothing). `sw`: the stride along the width, `sk`
 * along k, in elements. Two memory layouts are common and get loops without per-element index arithmetic:
 * k contiguous (sk == 1: each pair is one 32-bit word, copied whole) and the width contiguous (sw == 1: two
 * runs of k, interleaved). */
static inline uint32_t load_pair(const uint16_t *x) {
    uint32_t v;
    memcpy(&v, x, 4); /* the two bf16 of k and k + 1, low half first (little-endian: packed[w][0] = k) */
    return v;
}

static void pack_run(const uint16_t *x, int64_t sw, int64_t sk, int64_t k, int64_t valid, int width, int64_t k0,
                     int64_t pairs, uint16_t *packed) {
    const int64_t full = (k - k0) / 2 < pairs ? ((k - k0) > 0 ? (k - k0) / 2 : 0) : pairs; /* pairs inside k */
    if (valid == width && sk == 1) {
        uint32_t *dst = (uint32_t *)packed;
        for (int w = 0; w < width; w++) {
            const uint16_t *src = x + w * sw + k0;
            for (int64_t p = 0; p < full; p++) dst[p * width + w] = load_pair(src + 2 * p);
        }
    } else if (valid == width && sw == 1) {
        for (int64_t p = 0; p < full; p++) {
            const uint16_t *ra = x + (k0 + 2 * p) * sk, *rb = ra + sk;
            uint16_t *dst = packed + p * width * 2;
            for (int w = 0; w < width; w++) {
                dst[2 * w] = ra[w];
                dst[2 * w + 1] = rb[w];
            }
        }
    } else {
        for (int64_t p = 0; p < full; p++) {
            uint16_t *dst = packed + p * width * 2;
            const uint16_t *ra = x + (k0 + 2 * p) * sk, *rb = ra + sk;
            for (int64_t w = 0; w < valid; w++) {
                dst[2 * w] = ra[w * sw];
                dst[2 * w + 1] = rb[w * sw];
            }
            for (int64_t w = valid; w < width; w++) dst[2 * w] = dst[2 * w + 1] = 0;
        }
    }
    for (int64_t p = full; p < pairs; p++) { /* the last pairs: past k, or an odd k's last one */
        uint16_t *dst = packed + p * width * 2;
        const int64_t ka = k0 + 2 * p, kb = ka + 1;
        for (int64_t w = 0; w < width; w++) {
            dst[2 * w] = w < valid && ka < k ? x[w * sw + ka * sk] : 0;
            dst[2 * w + 1] = w < valid && kb < k ? x[w * sw + kb * sk] : 0;
        }
    }
}

/* b[k0:k0+2*pairs, n0:n0+NR] -> packed[pair][column][2] */
static void pack_b(const uint16_t *b, int64_t k, int64_t n, int64_t sbk, int64_t sbn, int64_t k0, int64_t pairs,
                   int64_t n0, uint16_t *packed) {
    pack_run(b + n0 * sbn, sbn, sbk, k, n - n0 < NR ? n - n0 : NR, NR, k0, pairs, packed);
}

/* a[m0:m0+MR, k0:k0+2*pairs] -> packed[pair][row][2] */
static void pack_a(const uint16_t *a, int64_t m, int64_t k, int64_t sam, int64_t sak, int64_t m0, int64_t k0,
                   int64_t pairs, uint16_t *packed) {
    pack_run(a + m0 * sam, sam, sak, k, m - m0 < MR ? m - m0 : MR, MR, k0, pairs, packed);
}

/* tile[MR][NR] = the packed pairs' sum, in K blocks of `block_pairs` pairs: with scales (sa[b * MR + i] per row,
 * sb[b * NR + j] per column of block b) each block's fresh fp32 sum is multiplied by its row's scale, then by its
 * column's, and added to the tile; without (sa NULL) one fp32 sum over all pairs. */
#if GEMM_VECTOR
static void tile_sum_vector(const uint16_t *pa, const uint16_t *pb, int64_t pairs, int64_t block_pairs, const float *sa,
                            const float *sb, float *tile, int64_t ld, int add) {
    __m512 out[MR][2];
    for (int i = 0; i < MR; i++) out[i][0] = out[i][1] = _mm512_setzero_ps();
    for (int64_t p0 = 0, b = 0; p0 < pairs; p0 += block_pairs, b++) {
        const int64_t p1 = p0 + block_pairs < pairs ? p0 + block_pairs : pairs;
        __m512 acc[MR][2];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t p = p0; p < p1; p++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pb + p * NR * 2);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pb + p * NR * 2 + 32);
            const uint32_t *ap = (const uint32_t *)(pa + p * MR * 2);
            for (int i = 0; i < MR; i++) {
                const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)ap[i]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
            }
        }
        if (sa) {
            const __m512 sb0 = _mm512_loadu_ps(sb + b * NR), sb1 = _mm512_loadu_ps(sb + b * NR + 16);
            for (int i = 0; i < MR; i++) {
                const __m512 s = _mm512_set1_ps(sa[b * MR + i]);
                out[i][0] = _mm512_add_ps(out[i][0], _mm512_mul_ps(_mm512_mul_ps(acc[i][0], s), sb0));
                out[i][1] = _mm512_add_ps(out[i][1], _mm512_mul_ps(_mm512_mul_ps(acc[i][1], s), sb1));
            }
        } else {
            for (int i = 0; i < MR; i++) out[i][0] = acc[i][0], out[i][1] = acc[i][1];
        }
    }
    for (int i = 0; i < MR; i++) { /* tile: ld floats per row; add: tile = tile + out (c + t), else tile = out */
        float *row = tile + i * ld;
        if (add) {
            out[i][0] = _mm512_add_ps(_mm512_loadu_ps(row), out[i][0]);
            out[i][1] = _mm512_add_ps(_mm512_loadu_ps(row + 16), out[i][1]);
        }
        _mm512_storeu_ps(row, out[i][0]);
        _mm512_storeu_ps(row + 16, out[i][1]);
    }
}
#endif

/* the same sums one product and one addition at a time: any CPU (and a reference for the vector loop) */
static void tile_sum_plain(const uint16_t *pa, const uint16_t *pb, int64_t pairs, int64_t block_pairs, const float *sa,
                           const float *sb, float *tile) {
    float acc[MR * NR];
    for (int i = 0; i < MR * NR; i++) tile[i] = 0.0f;
    for (int64_t p0 = 0, b = 0; p0 < pairs; p0 += block_pairs, b++) {
        const int64_t p1 = p0 + block_pairs < pairs ? p0 + block_pairs : pairs;
        for (int i = 0; i < MR * NR; i++) acc[i] = 0.0f;
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *ap = pa + p * MR * 2, *bp = pb + p * NR * 2;
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < NR; j++) {
                    /* the odd k first, then the even one: VDPBF16PS's order (Intel SDM) */
                    acc[i * NR + j] += bf16_to_f32(ap[2 * i + 1]) * bf16_to_f32(bp[2 * j + 1]);
                    acc[i * NR + j] += bf16_to_f32(ap[2 * i]) * bf16_to_f32(bp[2 * j]);
                }
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++)
                tile[i * NR + j] = sa ? tile[i * NR + j] + (acc[i * NR + j] * sa[b * MR + i]) * sb[b * NR + j]
                                      : acc[i * NR + j];
    }
}

typedef struct {
    const uint16_t *a, *b;
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
    const size_t a_panel = (size_t)MR * 2 * kc_used, b_panel = (size_t)NR * 2 * kc_used; /* in bf16 */
    uint16_t *pa = aligned_alloc(64, (size_t)mc_used * MR * 2 * kc_used * 2 + 64);
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
            pack_b(j->b, j->k, j->n, j->sbk, j->sbn, k0, pairs, n0, pb + np * b_panel);
            if (sb) /* per block: [block][column], 0 past n */
                for (int64_t b = 0; b < blocks; b++)
                    for (int64_t q = 0; q < NR; q++)
                        sb[(np * kc_blocks + b) * NR + q] = q < cols ? j->kscale_b[(kb0 + b) * j->n + n0 + q] : 0.0f;
        }
        for (int64_t mc = j->m_lo; mc < j->m_hi; mc += MC_PANELS) { /* a's panels, MC_PANELS at a time */
            const int64_t mc_panels = j->m_hi - mc < MC_PANELS ? j->m_hi - mc : MC_PANELS;
            for (int64_t mp = 0; mp < mc_panels; mp++) {
                const int64_t m0 = (mc + mp) * MR;
                pack_a(j->a, j->m, j->k, j->sam, j->sak, m0, k0, pairs, pa + mp * a_panel);
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
                    if (!j->plain && rows == MR && cols == NR && !(last && epilogue)) { /* straight into c */
                        tile_sum_vector(panel_a, panel_b, pairs, block_pairs, panel_sa, panel_sb,
                                        j->c + m0 * j->n + n0, j->n, p0 != 0);
                        continue;
                    }
                    if (!j->plain)
                        tile_sum_vector(panel_a, panel_b, pairs, block_pairs, panel_sa, panel_sb, tile, NR, 0);
                    else
#endif
                    tile_sum_plain(panel_a, panel_b, pairs, block_pairs, panel_sa, panel_sb, tile);
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

/* c = a @ b (see the top of this file), then the epilogue: times scale_a (NULL, one value: a_step 0, or one per
 * row: a_step 1), times scale_b (likewise per column), plus bias (NULL or one per column), each an fp32 operation,
 * and, with out_bf16, rounded to bf16 into out_bf16 (c is then a scratch sum). k_block: 0 (no K-block scales) or
 * the K block of kscale_a (m, K blocks) / kscale_b (K blocks, n), which must then be even and both given. plain:
 * 1 runs the plain C loop where the vector one is built too. Returns 0, or a negative number on an internal
 * error. */
int fp8_gemm_bf16(const uint16_t *a, const uint16_t *b, int64_t m, int64_t n, int64_t k, int64_t sam, int64_t sak,
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
        jobs[i] = (gemm_job){a, b, m, n, k, sam, sak, sbk, sbn, kscale_a, kscale_b, kscale_a ? k_block : k,
                             kscale_a ? (k + k_block - 1) / k_block : 1, scale_a, scale_b, a_step, b_step, bias,
                             c, out_bf16, split_rows ? lo : 0, split_rows ? hi : m_panels, split_rows ? 0 : lo,
                             split_rows ? n_panels : hi, plain, 0};
    }
    parallel_run(nthreads, gemm_worker, jobs, sizeof(gemm_job));
    for (int32_t i = 0; i < nthreads; i++)
        if (jobs[i].status) return jobs[i].status;
    return 0;
}
