/* Small-step decode, native: one call per layer boundary, reading fp32 or INT8 weights directly.
 *
 * Built at load by engine/models/native.py (gcc -O3 -fopenmp, AVX-512 or AVX2 + FMA as torch
 * dispatches on this CPU) and called through ctypes by engine/models/single_token.py. For the
 * Llama family the math is that of single_token.py's compiled graphs (_pre, _post, _post_pre,
 * _logits), which stay the fallback; Gemma 3's layer (QK-norm, sandwich norms, GeGLU, sliding
 * window: optional parts of layer_t) has no compiled twin, its eager forward is the fallback.
 * Attention runs here (pd_layer, read in place from the paged cache) or with the eager backend
 * between the calls.
 *
 * Why not the compiled graphs for INT8: inductor has no sign-extending load, so an INT8 GEMV
 * written in torch decodes bytes with shifts (4 shifts, 4 converts and 4 multiply-adds per
 * 32-bit word): measured 11 GB/s of weights on a 2-core AVX-512 Xeon, against 26 GB/s that
 * fp32 reaches on the same machine. Here a 16-byte load sign-extends to 16 lanes in one
 * instruction (vpmovsxbd), then one convert and one FMA. And each compiled call costs ~50 us of
 * guards and wrappers (x 30 layers per token); a ctypes call a few.
 *
 * Threads: OpenMP, the same libgomp (and so the same thread pool) torch's kernels use, sized by
 * the caller (torch.get_num_threads()). Each call is one parallel region; serial parts (norms,
 * rotary, SiLU: a few thousand floats) run in `single` blocks, GEMVs split their output rows.
 *
 * A linear is y[r, n] = s[n] * (x[r] . w[n]) - zs[n] * sum(x[r]) + b[n]: fp32 w [N, K] (s = 1,
 * zs = 0), or INT8 w [N, K] with its columns in interleave4 order (engine/quant/formats.py: byte
 * 4i + j is column j*K/4 + i), for which x is permuted the same way first. INT4 (per group of
 * `group` inputs): w = q * s[n, g] + o[n, g] (one FMA), o = -zero * s, y = x . w + b, with s and o
 * read from fp32 scales and zero points or from their compact form (row_scales); codes stored
 * [N, K/2] in blocks of 2 * VW columns, byte i of a block holding column i in its low nibble and
 * column VW + i in its high one (built by native.py for this library's VW), so that VW bytes
 * widen to two full vectors of weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vload_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define vsum(v) _mm512_reduce_add_ps(v)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vset1(f) _mm512_set1_ps(f)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vload_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define vset1(f) _mm256_set1_ps(f)
#define vload_i4(p, lo, hi) do {                                                                  \
        __m256i v_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)));                 \
        lo = _mm256_cvtepi32_ps(_mm256_and_si256(v_, _mm256_set1_epi32(15)));                     \
        hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v_, 4));                                         \
    } while (0)
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#error "native_decode.c needs AVX-512 or AVX2 + FMA (engine/models/native.py picks the flags)"
#endif

enum { W_F32 = 0, W_I8 = 1, W_I4 = 2 };

typedef struct {
    const void *w;    /* [n, k] fp32, int8 in interleave4 order, or int4 [n, k/2] (below) */
    const float *s;   /* [n] (int4: [n, k/group], the group scales) */
    const float *zs;  /* [n] (int4: [n, k/group], the group zero points) */
    const float *b;   /* [n] */
    int64_t n, k, kind, group;
    int64_t aq;       /* INT4, INT8: 1 = activations quantized to INT8 on the fly (below), 0 = fp32 */
    const uint8_t *meta; /* INT4: the compact scales and offsets (row_scales), read instead of s and
                          * zs; NULL: s and zs */
} lin_t;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* One decoder layer. The Llama family fills the first line; Gemma 3 (engine/models/gemma3.py) the
 * rest too, as data rather than a second copy of the layer: its norms are RMSNorms like Llama's
 * (GemmaRMSNorm's x * (1 + w) arrives with 1 + w precomputed in fp32, which is HF's own first
 * step: the same products), so what differs is which norms exist, the MLP's activation and the
 * attention window. */
typedef struct {
    lin_t qkv, o, gu, d;
    const float *ln1, *ln2;  /* the norms before attention and before the MLP */
    const float *q_norm, *k_norm;       /* NULL, or RMSNorm per head of q / k before rotary */
    const float *post_attn, *post_ffn;  /* NULL, or the norm of attention's / the MLP's output
                                         * before its residual add (Gemma's sandwich) */
    int64_t act;     /* ACT_SILU: silu(gate) * up; ACT_GELU_TANH: gelu_tanh(gate) * up */
    int64_t window;  /* > 0: each query sees only the last `window` positions (its own included) */
} layer_t;

typedef struct {
    int64_t hidden, inter, nq, nkv, head_dim, max_rows, threads;
    float eps;
    float *scratch; /* 4 * max_rows * max(hidden, 2 * inter, nq * head_dim) floats */
} ctx_t;

#define NB 4  /* weight rows per block: independent FMA chains, one weight load for every x row */
/* The INT8-activation kernels read blocks of NB adjacent rows (with fp32 activations every kind
 * now reads four streams a thread with its own prefetch: gemv_rows, below). A block's NB rows are
 * contiguous and so are the next blocks': each row's reader prefetches the same offset PF_AHEAD
 * blocks ahead, a cache line at a time. Measured when every kind read blocks: without it the
 * packed formats read 13 (INT8) and 10 (INT4) GB/s of weights from memory on a 2-core Xeon
 * where fp32 streams 25: a 16-byte load per 16 weights keeps too few cache misses in flight.
 * Measured there (30 layers + LM head, one token, median of 7 interleaved sweeps), PF_AHEAD 0
 * (none) / 1 / 2 / 3 / 4: INT8 9.8 / 5.4 / 4.9 / 4.9 / 4.7 ms, INT4 (g32) 8.4 / 5.9 / 5.7 / 5.5
 * / 5.6, fp32 20.3 / 17.5 / 18.0 / 18.1 / 18.5.
 * Into L2 (T1), not L1 (T0): on the 1.5B's shapes the lines PF_AHEAD blocks ahead (12 KB at
 * k = 1536 INT8, 72 KB at k = 8960) plus the block being read plus x fill or overflow a 32 KB
 * L1, so T0 evicted lines before their use and held L1's miss buffers. Measured on a 2-core
 * AVX-512 EPYC (Zen 4; a 17920 x 1536 GEMV over 16 copies, beyond L3, 2 threads): T0 / T1 / T2
 * INT8 24 / 49 / 49 GB/s, INT4 with INT8 activations 34 / 58 / 59 G weights/s, INT4 with fp32
 * activations 31 / 33 / 33 (then read in blocks: its unpacking bounded it there); PF_AHEAD 2,
 * 4, 8 within 3% of each other under T1. -DPF_HINT=_MM_HINT_T0 builds the old variant. */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#define PREFETCH(p) _mm_prefetch((const char *)(p), PF_HINT)
#ifndef PF_AHEAD
#define PF_AHEAD 2
#endif
#define RB 4  /* x rows per pass over a weight block (registers: NB * RB accumulators) */

#ifndef PF_ROW
/* bytes ahead in each stream: four streams 2 KB ahead keep 8 KB a thread in flight. Interleaved
 * against 8 KB (INT8, 2 threads, 600 MB): 512 B 0.89-0.91x the time, 1 KB 0.86-0.88, 2 KB
 * 0.87-0.88, 4 KB 0.96; fp32 and the AVX2 build 0.89-0.92 at 2 KB */
#define PF_ROW 2048
#endif

/* fp32 or INT8 weights (fp32 activations): out[j][r] = w[j] . x[r] for nr <= 4 weight rows read
 * side by side and rb <= RB x rows (one x row: two accumulators a weight row, for enough
 * independent FMA chains; more: one a pair). gemv_rows hands it one row from each quarter of a
 * thread's rows, so that a thread reads four long sequential streams (each quarter front to
 * back) rather than one: the memory system keeps more lines in flight for several streams than
 * its prefetchers do for one. Plain reads, 2 threads, 600 MB, a 2-core Xeon: 1 stream a thread
 * 21-22 GB/s (25 with a software prefetch), 4 streams 26-29. (Four adjacent rows side by side, as
 * this GEMV read them before, are four streams as short as a row, which the prefetchers follow
 * worst.) */
static inline __attribute__((always_inline)) float wload1(const char *w, int kind, int64_t c) {
    return kind == W_I8 ? (float)((const int8_t *)w)[c] : ((const float *)w)[c];
}
static inline __attribute__((always_inline)) vf wload(const char *w, int kind, int64_t c) {
    return kind == W_I8 ? vload_i8((const int8_t *)w + c) : vload((const float *)w + c);
}

/* Prefetch, PF_ROW ahead in each of nr streams, the cache lines starting within bytes [b0, b1)
 * of each (each line once) */
static inline __attribute__((always_inline)) void
prefetch_lines(const char *const w[4], int nr, int64_t b0, int64_t b1) {
    for (int64_t byte = b0; byte < b1; byte += 64)
        if ((byte & 63) == 0)
            for (int j = 0; j < nr; j++) PREFETCH(w[j] + byte + PF_ROW);
}

static inline __attribute__((always_inline)) void
dot_rows(const char *const w[4], int kind, int nr, int rb, int64_t k, const float *x, int64_t ldx,
         float out[4][RB]) {
    const int64_t esz = kind == W_I8 ? 1 : 4;
    int64_t c = 0;
    if (rb == 1) {  /* two accumulators a row: eight independent FMA chains */
        vf a[4], b[4];
        for (int j = 0; j < nr; j++) a[j] = b[j] = vzero();
        for (; c + 2 * VW <= k; c += 2 * VW) {
            prefetch_lines(w, nr, c * esz, (c + 2 * VW) * esz);
            const vf x0 = vload(x + c), x1 = vload(x + c + VW);
            for (int j = 0; j < nr; j++) {
                a[j] = vfma(wload(w[j], kind, c), x0, a[j]);
                b[j] = vfma(wload(w[j], kind, c + VW), x1, b[j]);
            }
        }
        for (; c + VW <= k; c += VW)
            for (int j = 0; j < nr; j++) a[j] = vfma(wload(w[j], kind, c), vload(x + c), a[j]);
        for (int j = 0; j < nr; j++) out[j][0] = vsum(vadd(a[j], b[j]));
    } else {  /* each weight vector loaded once for the rb x rows */
        vf a[4][RB];
        for (int j = 0; j < nr; j++)
            for (int r = 0; r < rb; r++) a[j][r] = vzero();
        for (; c + VW <= k; c += VW) {
            prefetch_lines(w, nr, c * esz, (c + VW) * esz);
            vf xr[RB];
            for (int r = 0; r < rb; r++) xr[r] = vload(x + r * ldx + c);
            for (int j = 0; j < nr; j++) {
                const vf wv = wload(w[j], kind, c);
                for (int r = 0; r < rb; r++) a[j][r] = vfma(wv, xr[r], a[j][r]);
            }
        }
        for (int j = 0; j < nr; j++)
            for (int r = 0; r < rb; r++) out[j][r] = vsum(a[j][r]);
    }
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < rb; r++)
            for (int64_t i = c; i < k; i++) out[j][r] += wload1(w[j], kind, i) * x[r * ldx + i];
}

#define ROWS_CASE(KIND, NR, RBV)                                                               \
    if (kind == KIND && nr == NR && rb == RBV) {                                               \
        dot_rows(w, KIND, NR, RBV, k, x, ldx, out);                                            \
        return;                                                                                \
    }
#define ROWS_CASES(KIND, NR) ROWS_CASE(KIND, NR, 1) ROWS_CASE(KIND, NR, 2) ROWS_CASE(KIND, NR, 3) ROWS_CASE(KIND, NR, 4)

static void dot_rows_any(const char *const w[4], int kind, int nr, int rb, int64_t k, const float *x, int64_t ldx,
                         float out[4][RB]) {
    ROWS_CASES(W_I8, 4) ROWS_CASES(W_I8, 1) ROWS_CASES(W_F32, 4) ROWS_CASES(W_F32, 1)
}

/* INT4 rows' group scales s and offsets o (w = q * s + o) into sv, ov (ng floats per row, rows
 * row0 .. row0 + nr - 1), from fp32 scales and zero points (o = -zero * s) or from the compact
 * form (engine/models/int4_blocks.py: per row and superblock of 8 groups, fp32 d and dm, then
 * uint8 sc[8] and m[8]; s = d * sc, off = dm * m, o = (off / s) * s, or off where s = 0: the
 * conversion's own zero = -off / s replayed, so that o is bit for bit the fp32 pair's, which
 * int4_blocks.py checked for every group before choosing this form). Either way every path
 * applies the same s and o. The compact form reads 0.75 bits per weight here instead of 2 (a
 * batch-1 step is bound by the bytes it reads); the arrays filled stay in L1 for the dot. */
static void row_scales(const lin_t *L, int64_t row0, int nr, float *sv, float *ov) {
    const int64_t ng = L->k / L->group;
    for (int j = 0; j < nr; j++) {
        float *s = sv + j * ng, *o = ov + j * ng;
        if (L->meta != NULL) {
            /* one superblock per 8-lane vector (both builds have AVX2): written out, since gcc
             * leaves the division scalar where it cannot mask it (AVX2) */
            const uint8_t *m = L->meta + (row0 + j) * (ng / 8) * 24;
            const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
            for (int64_t sb = 0; sb < ng / 8; sb++, m += 24) {
                float d, dm;
                memcpy(&d, m, 4);
                memcpy(&dm, m + 4, 4);
                const __m256 si = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                  _mm_loadl_epi64((const __m128i *)(m + 8)))));
                const __m256 off = _mm256_mul_ps(_mm256_set1_ps(dm), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                   _mm_loadl_epi64((const __m128i *)(m + 16)))));
                const __m256 nz = _mm256_cmp_ps(si, zero, _CMP_NEQ_UQ);  /* s = 0: o = off, no division */
                const __m256 back = _mm256_mul_ps(_mm256_div_ps(off, _mm256_blendv_ps(one, si, nz)), si);
                _mm256_storeu_ps(s + 8 * sb, si);
                _mm256_storeu_ps(o + 8 * sb, _mm256_blendv_ps(off, back, nz));
            }
        } else {
            const float *ps = L->s + (row0 + j) * ng, *pz = L->zs + (row0 + j) * ng;
            for (int64_t gi = 0; gi < ng; gi++) {
                s[gi] = ps[gi];
                o[gi] = -pz[gi] * ps[gi];
            }
        }
    }
}

/* INT4: out[j][r] = w[j] . x[r], the weights dequantized in registers a group at a time; s, o:
 * row_scales' arrays for the block's rows. */
static inline __attribute__((always_inline)) void
dot_block_i4(const char *const w[4], const float *s, const float *o, int64_t k, int64_t g, int nb, int rb,
             const float *x, int64_t ldx, float out[NB][RB]) {
    vf acc[NB][RB];
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < rb; r++) acc[j][r] = vzero();
    const int64_t ng = k / g;
    for (int64_t gi = 0; gi < ng; gi++) {
#if VW == 16
        /* The group's 16 possible weights q * s - zero * s, one FMA per row; then each code picks
         * its weight with one permute, which reads only the low 4 bits of its lane (so no mask,
         * no int->float convert, no per-weight FMA). Same operands as below: the same weights,
         * bit for bit. On a 2-core AVX-512 EPYC this cut the ops per 32 weights from 11 to 7
         * (one x row), when it read blocks of adjacent rows (it ran 2x faster on 2 threads than on
         * 1). */
        vf tab[NB];
        for (int j = 0; j < nb; j++)
            tab[j] = vfma(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                          vset1(s[j * ng + gi]), vset1(o[j * ng + gi]));
#else
        vf sv[NB], zv[NB];
        for (int j = 0; j < nb; j++) {
            sv[j] = vset1(s[j * ng + gi]);
            zv[j] = vset1(o[j * ng + gi]);
        }
#endif
        for (int64_t c = gi * g; c < (gi + 1) * g; c += 2 * VW) {
            prefetch_lines(w, nb, c / 2, c / 2 + VW);  /* (2 * VW codes: VW bytes) */
            vf xl[RB], xh[RB];
            for (int r = 0; r < rb; r++) {
                xl[r] = vload(x + r * ldx + c);
                xh[r] = vload(x + r * ldx + c + VW);
            }
            for (int j = 0; j < nb; j++) {
                vf lo, hi;
#if VW == 16
                __m512i v_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w[j] + c / 2)));
                lo = _mm512_permutexvar_ps(v_, tab[j]);
                hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v_, 4), tab[j]);
#else
                vload_i4(w[j] + c / 2, lo, hi);
                lo = vfma(lo, sv[j], zv[j]);
                hi = vfma(hi, sv[j], zv[j]);
#endif
                for (int r = 0; r < rb; r++) acc[j][r] = vfma(hi, xh[r], vfma(lo, xl[r], acc[j][r]));
            }
        }
    }
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < rb; r++) out[j][r] = vsum(acc[j][r]);
}

#define I4_CASE(NBV, RBV)                                                                      \
    if (nb == NBV && rb == RBV) {                                                              \
        dot_block_i4(w, s, o, k, g, NBV, RBV, x, ldx, out);                                    \
        return;                                                                                \
    }

static void dot_any_i4(const char *const w[4], const float *s, const float *o, int64_t k, int64_t g, int nb, int rb,
                       const float *x, int64_t ldx, float out[NB][RB]) {
    I4_CASE(4, 1) I4_CASE(4, 2) I4_CASE(4, 3) I4_CASE(4, 4)
    I4_CASE(1, 1) I4_CASE(1, 2) I4_CASE(1, 3) I4_CASE(1, 4)
}

/* y (+)= s * (x . w) - zs * xsum + b for an fp32 or INT8 linear, y (+)= x . w + b for INT4 (its
 * scales are inside the dot), at R x rows (fp32 activations), in a parallel region: each thread
 * its share of the rows in four streams (dot_rows, dot_block_i4), x rows in groups of RB, then a
 * barrier as an omp for ends with. INT8, 2 threads, beyond every cache,
 * interleaved with one stream a thread (docs/bench/README.md, "Four streams a thread"): one x row
 * 0.90-0.97x the time, then 0.86-0.88x of that with the 2 KB prefetch; the 1.5B's INT8 decode
 * step 71.0-79.0 -> 63.6-71.2 ms. Two to four x rows read the weights once, as one does: 17920 x
 * 1536 and the LM head at 2 x rows 17.9 -> 24.6 and 18.7 -> 26.0 GB/s, at 4 16.5 -> 21.4 and
 * 16.6 -> 23.0 (four adjacent rows before); past four, each group of four x rows reads the four
 * weight rows from L1 or L2 again (8 x rows: 0.92x the time, compute-bound). One x row sums in
 * two accumulators and more in one: an fp32 row's last bits may differ between a one-token step
 * and a batch (each within the same fp32 bound). INT4 read this way instead of in blocks of four
 * adjacent rows (one stream a thread), interleaved, 2 threads, 600 MB: 17920 x 1536 at one x row
 * 0.74x the time (14.4 -> 19.4 GB/s), 1536 x 8960 0.87x, 2 x rows 0.88x, 4 0.95x, 8 1.00x; the
 * AVX2 build 0.93x: its unpacking bounded it less than how it read memory. */
static void gemv_rows(const lin_t *L, int R, const float *x, const float *xsum, float *y, int64_t ldy, int add) {
    const int64_t n = L->n, k = L->k, row = L->kind == W_I8 ? k : L->kind == W_I4 ? k / 2 : 4 * k;
    const int64_t ng = L->kind == W_I4 ? k / L->group : 1;
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = n * t / nt, hi = n * (t + 1) / nt, q = (hi - lo) / 4;
    const char *w = (const char *)L->w;
    float sv[4 * ng], ov[4 * ng];  /* INT4: the four rows' group scales and offsets */
    for (int64_t i = 0; i < hi - lo - 3 * q; i++) {  /* the last quarter takes the rows left over */
        const int nr = i < q ? 4 : 1;
        const int64_t rows[4] = {lo + 3 * q + i, lo + i, lo + q + i, lo + 2 * q + i};
        const char *wr[4] = {w + rows[0] * row, w + rows[1] * row, w + rows[2] * row, w + rows[3] * row};
        if (L->kind == W_I4)
            for (int j = 0; j < nr; j++) row_scales(L, rows[j], 1, sv + j * ng, ov + j * ng);
        for (int r0 = 0; r0 < R; r0 += RB) {  /* (past the first RB x rows, the rows sit in L1 or L2) */
            const int rb = R - r0 < RB ? R - r0 : RB;
            float out[4][RB];
            if (L->kind == W_I4) dot_any_i4(wr, sv, ov, k, L->group, nr, rb, x + r0 * k, k, out);
            else dot_rows_any(wr, (int)L->kind, nr, rb, k, x + r0 * k, k, out);
            for (int j = 0; j < nr; j++)
                for (int r = 0; r < rb; r++) {
                    const int64_t c = rows[j];
                    const float v = L->kind == W_I4 ? out[j][r] + L->b[c]
                                                    : L->s[c] * out[j][r] - L->zs[c] * xsum[r0 + r] + L->b[c];
                    float *dst = y + (r0 + r) * ldy + c;
                    *dst = add ? *dst + v : v;
                }
        }
    }
#pragma omp barrier
}

/* ---- INT4 weights x INT8 activations (opt-in, lin_t.aq: llama.cpp's arithmetic) -----------------
 *
 * The fp32-activation kernel above converts each code to a float before its FMA (on one core
 * that, more than memory, bounds it: gemv_rows). Here the activations are quantized once per
 * call instead, and the codes multiply them as bytes: one VNNI vpdpbusd does 64 code x
 * activation products (unsigned 0..15 x signed -127..127, summed in fours into int32); without
 * VNNI, vpmaddubsw + vpmaddwd do the same exactly (a pair sums to at most 2 * 15 * 127, no int16
 * saturation). One int->float convert and one FMA per
 * 4 * VW weights apply the weight group's scale times the activation group's.
 *
 * Activations: per row, groups of 32 consecutive inputs, d = max|x| / 127, q = rint(x * (127 /
 * max|x|)) (round half to even; d = 0 and q = 0 for an all-zero group): the same numbers on
 * every ISA. Stored in the weight's byte order: per chunk of 8 * VW inputs (one vector of
 * packed codes: 4 blocks of 2 * VW), first the 4 * VW inputs the low nibbles multiply (each
 * block's first VW columns), then the 4 * VW the high ones do. Each 32-bit lane of a chunk's
 * dot covers one block's columns, so one weight group and one activation group (groups of 32
 * columns or multiples, blocks of 2 * VW <= 32): xd holds, per chunk, each lane's activation
 * scale. The zero point term, sum over groups of s * zero * (sum of the group's inputs), uses
 * the quantized inputs' group sums (xg: sum over the group's activation groups of d * (sum of
 * codes)), as llama.cpp's Q8_K block sums do: the weight is then s * (code - zero), centred,
 * times the quantized input, and the quantization's error is multiplied by the centred weight.
 * With the exact fp32 sums it was multiplied by the code (0..15) instead and never taken back
 * (what that cost: docs/bench/README.md, INT8 activations).
 *
 * Buffer of one call, R rows: [xq int8 R * k][xd float R * k/8][xg float R * k/group]. */
#define A8_CHUNK (8 * VW)

#if VW == 16
typedef __m512i vi;
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_nibbles(v, lo, hi) do {                                                                 \
        const __m512i m4_ = _mm512_set1_epi8(15);                                                  \
        lo = _mm512_and_si512(v, m4_);                                                             \
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4_);                                       \
    } while (0)
static inline __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
static inline __m512 lane_dot(__m512i lo, __m512i hi, __m512i xl, __m512i xh) {
#if defined(__AVX512VNNI__)
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh));
#else
    __m512i t = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xl), _mm512_maddubs_epi16(hi, xh));
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(t, _mm512_set1_epi16(1)));
#endif
}
/* the first n (<= VW) floats at p, zeros after (never reads past p + n) */
static inline __m512 vload_n(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
typedef __m512i vidx;
static inline vidx lane_index(const int *ix) { return _mm512_loadu_si512((const void *)ix); }
/* each lane's weight-group scale: n (<= VW) consecutive scales from s, spread by idx */
static inline __m512 lane_scales(const float *s, int n, vidx idx) {
    return _mm512_permutexvar_ps(idx, vload_n(s, n));
}
#else
typedef __m256i vi;
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_nibbles(v, lo, hi) do {                                                                 \
        const __m256i m4_ = _mm256_set1_epi8(15);                                                  \
        lo = _mm256_and_si256(v, m4_);                                                             \
        hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4_);                                       \
    } while (0)
static inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
static inline __m256 lane_dot(__m256i lo, __m256i hi, __m256i xl, __m256i xh) {
    __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(t, _mm256_set1_epi16(1)));
}
static inline __m256 vload_n(const float *p, int n) {
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
typedef __m256i vidx;
static inline vidx lane_index(const int *ix) { return _mm256_loadu_si256((const __m256i *)ix); }
static inline __m256 lane_scales(const float *s, int n, vidx idx) {
    return _mm256_permutevar8x32_ps(vload_n(s, n), idx);
}
#endif

/* One activation's code in its group: rint(x * (127 / max|x|)), round half to even, in -127..127. */
static inline int8_t q8(float x, float inv) {
    float q = rintf(x * inv);
    return (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
}

/* Row r's activations quantized into the buffer's three parts (layout above). */
static void quant_x_a8(const lin_t *L, int R, const float *x, void *buf) {
    const int64_t k = L->k, g = L->group, ng = k / g, na = k / 32;
    int8_t *xq = (int8_t *)buf;
    float *xd = (float *)(xq + (int64_t)R * k), *xg = xd + (int64_t)R * (k / 8);
    float ad[na];
    int sums[na];
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * k;
        int8_t *qr = xq + (int64_t)r * k;
        for (int64_t a = 0; a < na; a++) {
            float m = 0.f;
            for (int i = 0; i < 32; i++) m = fmaxf(m, fabsf(xr[32 * a + i]));
            const float inv = m > 0.f ? 127.f / m : 0.f;
            ad[a] = m / 127.f;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                const int64_t col = 32 * a + i, c0 = col - col % A8_CHUNK, off = col - c0;
                const int64_t t = off / (2 * VW), wi = off % (2 * VW);
                const int64_t pos = c0 + (wi < VW ? t * VW + wi : 4 * VW + t * VW + wi - VW);
                qr[pos] = q8(xr[col], inv);
                sum += qr[pos];
            }
            sums[a] = sum;
        }
        float *dr = xd + (int64_t)r * (k / 8);
        for (int64_t c = 0; c < k; c += A8_CHUNK)
            for (int l = 0; l < VW; l++) dr[c / 8 + l] = ad[(c + (4 * l / VW) * 2 * VW) / 32];
        for (int64_t gi = 0; gi < ng; gi++) {
            float t = 0.f;
            for (int64_t a = gi * (g / 32); a < (gi + 1) * (g / 32); a++) t += ad[a] * (float)sums[a];
            xg[(int64_t)r * ng + gi] = t;
        }
    }
}

/* out[j][r] = w[j] . x[r] from the quantized activations (buffer parts xq, xd, xg of R rows); s,
 * o: row_scales' arrays for the block's rows. */
static inline __attribute__((always_inline)) void
dot_block_i4a8(const uint8_t *w, const float *s, const float *o, int64_t k, int64_t g, int nb, int rb,
               const int8_t *xq, const float *xd, const float *xg, float out[NB][RB]) {
    vf acc[NB][RB];
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < rb; r++) acc[j][r] = vzero();
    const int64_t ng = k / g;
    const int ngc = g >= A8_CHUNK ? 1 : (int)(A8_CHUNK / g);  /* weight groups per chunk */
    int ix[VW];
    for (int l = 0; l < VW; l++) ix[l] = (int)(((4 * l / VW) * 2 * VW) / g);
    const vidx idx = lane_index(ix);
    for (int64_t c = 0; c < k; c += A8_CHUNK) {
        if (((c / 2) & 63) == 0)
            for (int j = 0; j < nb; j++) PREFETCH(w + (PF_AHEAD * NB + j) * (k / 2) + c / 2);
        vi xl[RB], xh[RB];
        vf dv[RB];
        for (int r = 0; r < rb; r++) {
            xl[r] = vi_load(xq + r * k + c);
            xh[r] = vi_load(xq + r * k + c + 4 * VW);
            dv[r] = vload(xd + r * (k / 8) + c / 8);
        }
        for (int j = 0; j < nb; j++) {
            vi v = vi_load(w + j * (k / 2) + c / 2), lo, hi;
            vi_nibbles(v, lo, hi);
            const vf sv = lane_scales(s + j * ng + c / g, ngc, idx);
            for (int r = 0; r < rb; r++) acc[j][r] = vfma(lane_dot(lo, hi, xl[r], xh[r]), vmul(sv, dv[r]), acc[j][r]);
        }
    }
    /* plus the offsets' term, sum over groups of o * (the group's input sum), VW groups at a time
     * (a scalar loop here cost more than the dot above: 3 ops per 32 weights) */
    for (int j = 0; j < nb; j++) {
        vf zt[RB];
        for (int r = 0; r < rb; r++) zt[r] = vzero();
        for (int64_t gi = 0; gi < ng; gi += VW) {
            const int n = ng - gi < VW ? (int)(ng - gi) : VW;
            const vf ov = vload_n(o + j * ng + gi, n);
            for (int r = 0; r < rb; r++) zt[r] = vfma(ov, vload_n(xg + r * ng + gi, n), zt[r]);
        }
        for (int r = 0; r < rb; r++) out[j][r] = vsum(acc[j][r]) + vsum(zt[r]);
    }
}

#define A8_CASE(NBV, RBV)                                                                      \
    if (nb == NBV && rb == RBV) {                                                              \
        dot_block_i4a8(w, s, o, k, g, NBV, RBV, xq, xd, xg, out);                              \
        return;                                                                                \
    }

static void dot_any_i4a8(const uint8_t *w, const float *s, const float *o, int64_t k, int64_t g, int nb, int rb,
                         const int8_t *xq, const float *xd, const float *xg, float out[NB][RB]) {
    A8_CASE(4, 1) A8_CASE(4, 2) A8_CASE(4, 3) A8_CASE(4, 4)
    A8_CASE(1, 1) A8_CASE(1, 2) A8_CASE(1, 3) A8_CASE(1, 4)
}

/* ---- INT8 weights x INT8 activations (the same opt-in, lin_t.aq) ---------------------------------
 *
 * The weight is INT8 [n, k] in interleave4 order, one scale per output row (s, zs as above).
 * Activations: quantized as for INT4 but in the weight's byte order, groups of 32 consecutive
 * bytes (8 words: inputs i..i+7 of each quarter of the row), so that a vector of 4 * VW weight
 * bytes spans whole groups: xq int8 [R, k], xd [R, k/32] the group scales.
 *  - VNNI: vpdpbusd wants one unsigned operand: the weights as w + 128 (flip the top bit),
 *    exact, then minus 128 * (sum of the group's codes) per group, which depends on the row of
 *    x only: xc[r] = 128 * sum over groups of d * (sum of codes), subtracted once at the end.
 *  - otherwise: both operands widened to int16 and vpmaddwd (a u8 x s8 vpmaddubsw would
 *    saturate: 2 * 255 * 127 > 32767), each half vector in one group.
 * Both are exact integer dots; only the fp32 sums' order differs.
 * Buffer of one call, R rows: [xq int8 R * k][xd float R * k/32][xc float R]. */
static void quant_x_i8a8(const lin_t *L, int R, const float *x, void *buf) {
    const int64_t k = L->k, k4 = k / 4, na = k / 32;
    int8_t *xq = (int8_t *)buf;
    float *xd = (float *)(xq + (int64_t)R * k), *xc = xd + (int64_t)R * na;
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * k;
        int8_t *qr = xq + (int64_t)r * k;
        float c = 0.f;
        for (int64_t a = 0; a < na; a++) {  /* group a: bytes 32a..32a+31, inputs j * k4 + i */
            float m = 0.f;
            for (int64_t i = 8 * a; i < 8 * a + 8; i++)
                for (int j = 0; j < 4; j++) m = fmaxf(m, fabsf(xr[j * k4 + i]));
            const float inv = m > 0.f ? 127.f / m : 0.f, d = m / 127.f;
            int sq = 0;
            for (int64_t i = 8 * a; i < 8 * a + 8; i++)
                for (int j = 0; j < 4; j++) {
                    qr[4 * i + j] = q8(xr[j * k4 + i], inv);
                    sq += qr[4 * i + j];
                }
            xd[(int64_t)r * na + a] = d;
            c += d * (float)sq;
        }
        xc[r] = 128.f * c;
    }
}

#if VW == 16
/* each lane's group scale in a 64-byte chunk: lanes 0-7 group a, 8-15 group a + 1 */
static inline __m512 chunk_scales(const float *d) {
    return _mm512_insertf32x8(_mm512_set1_ps(d[0]), _mm256_set1_ps(d[1]), 1);
}
#if defined(__AVX512VNNI__)
#define I8A8_VNNI 1
#endif
#else
static inline __m256 chunk_scales(const float *d) { return _mm256_set1_ps(d[0]); }  /* 32 bytes, one group */
#endif

static inline __attribute__((always_inline)) void
dot_block_i8a8(const int8_t *w, int64_t k, int nb, int rb, const int8_t *xq, const float *xd, const float *xc,
               float out[NB][RB]) {
    vf acc[NB][RB];
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < rb; r++) acc[j][r] = vzero();
    const int64_t na = k / 32;
    for (int64_t c = 0; c < k; c += 4 * VW) {
        if ((c & 63) == 0)
            for (int j = 0; j < nb; j++) PREFETCH(w + (PF_AHEAD * NB + j) * k + c);
        vf dv[RB];
        for (int r = 0; r < rb; r++) dv[r] = chunk_scales(xd + r * na + c / 32);
#if defined(I8A8_VNNI)
        __m512i xv[RB];
        for (int r = 0; r < rb; r++) xv[r] = _mm512_loadu_si512((const void *)(xq + r * k + c));
        for (int j = 0; j < nb; j++) {
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + j * k + c)),
                                               _mm512_set1_epi8((char)0x80));
            for (int r = 0; r < rb; r++)
                acc[j][r] = vfma(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xv[r])), dv[r],
                                 acc[j][r]);
        }
#elif VW == 16
        __m512i xl[RB], xh[RB];
        for (int r = 0; r < rb; r++) {
            xl[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(xq + r * k + c)));
            xh[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(xq + r * k + c + 32)));
        }
        for (int j = 0; j < nb; j++) {
            const __m512i wl = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + j * k + c)));
            const __m512i wh = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + j * k + c + 32)));
            for (int r = 0; r < rb; r++) {
                /* lanes of the low half are group c/32's, of the high half the next one's */
                __m512i lo = _mm512_madd_epi16(wl, xl[r]), hi = _mm512_madd_epi16(wh, xh[r]);
                acc[j][r] = vfma(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(xd[r * na + c / 32]), acc[j][r]);
                acc[j][r] = vfma(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(xd[r * na + c / 32 + 1]), acc[j][r]);
            }
        }
        (void)dv;
#else
        __m256i xl[RB], xh[RB];
        for (int r = 0; r < rb; r++) {
            xl[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + r * k + c)));
            xh[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + r * k + c + 16)));
        }
        for (int j = 0; j < nb; j++) {
            const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j * k + c)));
            const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j * k + c + 16)));
            for (int r = 0; r < rb; r++) {  /* 32 bytes: one group */
                __m256i t = _mm256_add_epi32(_mm256_madd_epi16(wl, xl[r]), _mm256_madd_epi16(wh, xh[r]));
                acc[j][r] = vfma(_mm256_cvtepi32_ps(t), dv[r], acc[j][r]);
            }
        }
#endif
    }
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < rb; r++) {
#if defined(I8A8_VNNI)
            out[j][r] = vsum(acc[j][r]) - xc[r];
#else
            (void)xc;
            out[j][r] = vsum(acc[j][r]);
#endif
        }
}

#define I8A8_CASE(NBV, RBV)                                                                    \
    if (nb == NBV && rb == RBV) {                                                              \
        dot_block_i8a8(w, k, NBV, RBV, xq, xd, xc, out);                                       \
        return;                                                                                \
    }

static void dot_any_i8a8(const int8_t *w, int64_t k, int nb, int rb, const int8_t *xq, const float *xd,
                         const float *xc, float out[NB][RB]) {
    I8A8_CASE(4, 1) I8A8_CASE(4, 2) I8A8_CASE(4, 3) I8A8_CASE(4, 4)
    I8A8_CASE(1, 1) I8A8_CASE(1, 2) I8A8_CASE(1, 3) I8A8_CASE(1, 4)
}

/* Bytes of the quantized-activation buffer for R rows of L. */
static int64_t a8_bytes(const lin_t *L, int R) {
    if (L->kind == W_I8) return (int64_t)R * (L->k + 4 * (L->k / 32) + 4);
    return (int64_t)R * (L->k + 4 * (L->k / 8) + 4 * (L->k / L->group));
}

/* y[r, n] (+)= s[n] * (x[r] . w[n]) - zs[n] * xsum[r] + b[n], output rows split over the team.
 * Called inside a parallel region. x [R, k] in the weight's column order, or for INT4 with aq
 * the quantized-activation buffer (quant_x_a8); ldy: y's row stride. */
static void gemv(const lin_t *L, int R, const float *x, const float *xsum, float *y, int64_t ldy, int add) {
    if (!L->aq) {  /* fp32 activations */
        gemv_rows(L, R, x, xsum, y, ldy, add);
        return;
    }
    /* below: INT4 and INT8 with INT8 activations, in blocks of NB adjacent rows */
    const int64_t n = L->n, k = L->k;
    const int64_t wrow = L->kind == W_I4 ? k / 2 : k;
    const int64_t ng = L->kind == W_I4 ? k / L->group : 1;
    const int64_t nblk = (n + NB - 1) / NB;
#pragma omp for schedule(static)
    for (int64_t bi = 0; bi < nblk; bi++) {
        int64_t n0 = bi * NB;
        int nb = n - n0 < NB ? (int)(n - n0) : NB;
        const char *w = (const char *)L->w + n0 * wrow;
        float sv[L->kind == W_I4 ? NB * ng : 1], ov[L->kind == W_I4 ? NB * ng : 1];
        if (L->kind == W_I4) row_scales(L, n0, nb, sv, ov);
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            float out[NB][RB];
            for (int j0 = 0; j0 < nb; j0 += (nb == NB ? NB : 1)) {  /* a tail block: row by row */
                float o1[NB][RB];
                const char *wj = w + j0 * wrow;
                if (L->kind == W_I4 && L->aq) {
                    const int8_t *xq = (const int8_t *)x;
                    const float *xd = (const float *)(xq + (int64_t)R * k), *xg = xd + (int64_t)R * (k / 8);
                    dot_any_i4a8((const uint8_t *)wj, sv + j0 * ng, ov + j0 * ng, k, L->group,
                                 nb == NB ? NB : 1, rb, xq + r0 * k, xd + r0 * (k / 8), xg + r0 * ng, o1);
                } else if (L->kind == W_I8 && L->aq) {
                    const int8_t *xq = (const int8_t *)x;
                    const float *xd = (const float *)(xq + (int64_t)R * k), *xc = xd + (int64_t)R * (k / 32);
                    dot_any_i8a8((const int8_t *)wj, k, nb == NB ? NB : 1, rb, xq + r0 * k, xd + r0 * (k / 32),
                                 xc + r0, o1);
                }
                for (int j = 0; j < (nb == NB ? NB : 1); j++)
                    for (int r = 0; r < rb; r++) out[j0 + j][r] = o1[j][r];
            }
            for (int j = 0; j < nb; j++)
                for (int r = 0; r < rb; r++) {
                    int64_t c = n0 + j;
                    float v = L->kind == W_I4 ? out[j][r] + L->b[c]
                                              : L->s[c] * out[j][r] - L->zs[c] * xsum[r0 + r] + L->b[c];
                    float *dst = y + (int64_t)(r0 + r) * ldy + c;
                    *dst = add ? *dst + v : v;
                }
        }
    }
}

/* The activations a linear reads, in its column order (interleave4 for INT8; quantized for INT4
 * with aq, into perm, which holds 4 * R * k bytes), and their sums. */
static const float *prepare_x(const lin_t *L, int R, const float *x, float *perm, float *xsum) {
    const int64_t k = L->k;
    for (int r = 0; r < R; r++) {
        float s = 0.f;
        for (int64_t c = 0; c < k; c++) s += x[r * k + c];
        xsum[r] = s;
    }
    if (L->aq) {  /* (xsum above stays: the INT8 zero-point term reads it) */
        if (L->kind == W_I4) quant_x_a8(L, R, x, perm);
        else quant_x_i8a8(L, R, x, perm);
        return perm;
    }
    if (L->kind != W_I8) return x;
    const int64_t k4 = k / 4;
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < k4; i++)
            for (int j = 0; j < 4; j++) perm[r * k + 4 * i + j] = x[r * k + j * k4 + i];
    return perm;
}

/* Whether a linear reads prepare_x's buffer rather than x itself. */
static int permuted(const lin_t *L) { return L->kind == W_I8 || L->aq; }

/* HF's RMSNorm: w * (x * rsqrt(mean(x^2) + eps)); out may be x (in place) */
static void rms(const float *x, const float *w, float *out, int R, int64_t h, float eps) {
    for (int r = 0; r < R; r++) {
        float ss = 0.f;
        for (int64_t c = 0; c < h; c++) ss += x[r * h + c] * x[r * h + c];
        float inv = 1.0f / sqrtf(ss / (float)h + eps);
        for (int64_t c = 0; c < h; c++) out[r * h + c] = w[c] * (x[r * h + c] * inv);
    }
}

/* h += norm(y) (Gemma's sandwich: the norm's product rounded, then added, as two fp32 ops in HF;
 * the library is built with -ffp-contract=off, so no FMA joins them) */
static void rms_add(const float *y, const float *w, float *h, int R, int64_t hid, float eps) {
    for (int r = 0; r < R; r++) {
        float ss = 0.f;
        for (int64_t c = 0; c < hid; c++) ss += y[r * hid + c] * y[r * hid + c];
        float inv = 1.0f / sqrtf(ss / (float)hid + eps);
        for (int64_t c = 0; c < hid; c++) h[r * hid + c] += w[c] * (y[r * hid + c] * inv);
    }
}

/* torch's gelu(approximate="tanh") in fp32, its operations in its order (aten's CPU kernel:
 * 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3))), kBeta = sqrt(2 / pi) rounded from double).
 * tanhf is glibc's where torch's vector loop has Sleef's (both within about 1 ulp): the only
 * difference, which greedy tokens do not see (tests/engine/test_native_decode.py). */
static inline float gelu_tanh(float x) {
    const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
    const float cube = x * x * x, inner = beta * (x + kappa * cube);
    return 0.5f * x * (1.0f + tanhf(inner));
}

typedef struct {
    float *a, *b, *c, *xsum;
} bufs_t;

static bufs_t buffers(const ctx_t *ctx) {
    int64_t wide = ctx->hidden > 2 * ctx->inter ? ctx->hidden : 2 * ctx->inter;
    wide = wide > ctx->nq * ctx->head_dim ? wide : ctx->nq * ctx->head_dim;
    int64_t one = ctx->max_rows * wide;
    bufs_t b = {ctx->scratch, ctx->scratch + one, ctx->scratch + 2 * one, ctx->scratch + 3 * one};
    return b;
}

/* norm + qkv_proj (+ the q/k norms) + rotary: qkv [R, nq + 2 nkv, D], q and k rotated; cos/sin
 * [R, D/2], the table of L's kind (Gemma's local and global layers have their own). */
static void pre_in_team(const ctx_t *ctx, const layer_t *L, int R, const float *h, const float *cos,
                        const float *sin, float *qkv) {
    bufs_t bf = buffers(ctx);
    const float *x;
#pragma omp single
    {
        rms(h, L->ln1, bf.a, R, ctx->hidden, ctx->eps);
        prepare_x(&L->qkv, R, bf.a, bf.b, bf.xsum);
    }
    x = permuted(&L->qkv) ? bf.b : bf.a;
    gemv(&L->qkv, R, x, bf.xsum, qkv, L->qkv.n, 0);
#pragma omp single
    {
        const int64_t d = ctx->head_dim, half = d / 2, heads = ctx->nq + ctx->nkv, width = L->qkv.n;
        for (int r = 0; r < R; r++)
            for (int64_t hh = 0; hh < heads; hh++) {
                float *v = qkv + r * width + hh * d;
                const float *cs = cos + r * half, *sn = sin + r * half;
                const float *nw = hh < ctx->nq ? L->q_norm : L->k_norm;
                if (nw != NULL) rms(v, nw, v, 1, d, ctx->eps);
                for (int64_t i = 0; i < half; i++) {
                    float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * cs[i] - x2 * sn[i];
                    v[i + half] = x2 * cs[i] + x1 * sn[i];
                }
            }
    }
}

/* h += o_proj(o); h += down(act(gate) * up) of norm(h), in place; with the sandwich norms,
 * h += post_attn(o_proj(o)) and h += post_ffn(down(...)), the projections written to c first. */
static void post_in_team(const ctx_t *ctx, const layer_t *L, int R, float *h, const float *o) {
    bufs_t bf = buffers(ctx);
    const int64_t hid = ctx->hidden, inter = ctx->inter;
#pragma omp single
    prepare_x(&L->o, R, o, bf.b, bf.xsum);
    gemv(&L->o, R, permuted(&L->o) ? bf.b : o, bf.xsum, L->post_attn ? bf.c : h, hid, L->post_attn == NULL);
#pragma omp single
    {
        if (L->post_attn != NULL) rms_add(bf.c, L->post_attn, h, R, hid, ctx->eps);
        rms(h, L->ln2, bf.a, R, hid, ctx->eps);
        prepare_x(&L->gu, R, bf.a, bf.b, bf.xsum);
    }
    gemv(&L->gu, R, permuted(&L->gu) ? bf.b : bf.a, bf.xsum, bf.c, 2 * inter, 0);
    /* split over the team: a libm tanhf or expf per element is ~10 ns, 2048 per layer for Gemma */
#pragma omp for schedule(static)
    for (int64_t ri = 0; ri < R * inter; ri++) {
        const int64_t r = ri / inter, i = ri % inter;
        const float g = bf.c[r * 2 * inter + i], u = bf.c[r * 2 * inter + inter + i];
        bf.a[ri] = (L->act == ACT_GELU_TANH ? gelu_tanh(g) : g / (1.0f + expf(-g))) * u;
    }
#pragma omp single
    prepare_x(&L->d, R, bf.a, bf.b, bf.xsum);
    gemv(&L->d, R, permuted(&L->d) ? bf.b : bf.a, bf.xsum, L->post_ffn ? bf.c : h, hid, L->post_ffn == NULL);
    if (L->post_ffn != NULL) {
#pragma omp single
        rms_add(bf.c, L->post_ffn, h, R, hid, ctx->eps);
    }
}

void pd_pre(const ctx_t *ctx, const layer_t *L, int R, const float *h, const float *cos, const float *sin,
            float *qkv) {
#pragma omp parallel num_threads(ctx->threads)
    pre_in_team(ctx, L, R, h, cos, sin, qkv);
}

void pd_post(const ctx_t *ctx, const layer_t *L, int R, float *h, const float *o) {
#pragma omp parallel num_threads(ctx->threads)
    post_in_team(ctx, L, R, h, o);
}

void pd_post_pre(const ctx_t *ctx, const layer_t *L, const layer_t *next, int R, float *h, const float *o,
                 const float *cos, const float *sin, float *qkv) {
#pragma omp parallel num_threads(ctx->threads)
    {
        post_in_team(ctx, L, R, h, o);
        pre_in_team(ctx, next, R, h, cos, sin, qkv);
    }
}

/* Where the step's new tokens go and what each attends to, shared by all layers. */
typedef struct {
    const int64_t *slots;  /* [R] cache slot of each new token */
    const int64_t *pos;    /* [R] its position: it attends to its request's positions 0..pos */
    const int64_t *tables; /* [R, width] the block table of its request */
    int64_t width, block_size;
    float scale;
} attn_t;

#define KCHUNK 64 /* keys scored per pass: one max and one rescale per chunk, not per key */

/* Writes the new tokens' K/V (rows of qkv) to their cache slots, then each token's attention
 * over its request's positions 0..pos (with a window W > 0, pos - W + 1..pos: HF's sliding
 * window, p - W < k <= p), read in place from the paged cache [slots, nkv, D] (no gather):
 * softmax in fp32, one (token, query head) pair per work item. o [R, nq * D]. */
static void attend_in_team(const ctx_t *ctx, int R, const float *qkv, int64_t width, int64_t window,
                           const attn_t *at, float *kc, float *vc, float *o) {
    const int64_t d = ctx->head_dim, nq = ctx->nq, nkv = ctx->nkv, group = nq / nkv, bs = at->block_size;
#pragma omp single
    for (int t = 0; t < R; t++) {
        const float *row = qkv + t * width;
        memcpy(kc + at->slots[t] * nkv * d, row + nq * d, nkv * d * sizeof(float));
        memcpy(vc + at->slots[t] * nkv * d, row + (nq + nkv) * d, nkv * d * sizeof(float));
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < R * nq; item++) {
        const int64_t t = item / nq, hq = item % nq, kvh = hq / group, n = at->pos[t] + 1;
        const int64_t first = window > 0 && n > window ? n - window : 0;
        const float *q = qkv + t * width + hq * d;
        const int64_t *table = at->tables + t * at->width;
        float acc[256], sc[KCHUNK], m = -INFINITY, l = 0.f;
        for (int64_t c = 0; c < d; c++) acc[c] = 0.f;
        for (int64_t j0 = first; j0 < n; j0 += KCHUNK) {
            const int64_t nj = n - j0 < KCHUNK ? n - j0 : KCHUNK;
            float cmax = -INFINITY;
            for (int64_t j = 0; j < nj; j++) {
                const int64_t p = j0 + j, slot = table[p / bs] * bs + p % bs;
                const float *k = kc + (slot * nkv + kvh) * d;
                vf a = vzero();
                for (int64_t c = 0; c < d; c += VW) a = vfma(vload(q + c), vload(k + c), a);
                sc[j] = vsum(a) * at->scale;
                cmax = sc[j] > cmax ? sc[j] : cmax;
            }
            if (cmax > m) {  /* rescale what was summed under the old max */
                const float f = expf(m - cmax);
                l *= f;
                for (int64_t c = 0; c < d; c++) acc[c] *= f;
                m = cmax;
            }
            for (int64_t j = 0; j < nj; j++) {
                const int64_t p = j0 + j, slot = table[p / bs] * bs + p % bs;
                const float *v = vc + (slot * nkv + kvh) * d;
                const float w = expf(sc[j] - m);
                l += w;
                for (int64_t c = 0; c < d; c++) acc[c] += w * v[c];
            }
        }
        float *out = o + t * nq * d + hq * d;
        for (int64_t c = 0; c < d; c++) out[c] = acc[c] / l;
    }
}

/* One layer boundary with attention: layer L's attention (K/V written first), o_proj and MLP into
 * h, then (next != NULL) the next layer's norm + qkv + rotary into qkv (cos/sin: next's table). */
void pd_layer(const ctx_t *ctx, const layer_t *L, const layer_t *next, int R, float *h, float *qkv, float *o,
              const float *cos, const float *sin, const attn_t *at, float *kc, float *vc) {
#pragma omp parallel num_threads(ctx->threads)
    {
        attend_in_team(ctx, R, qkv, L->qkv.n, L->window, at, kc, vc, o);
        post_in_team(ctx, L, R, h, o);
        if (next != NULL) pre_in_team(ctx, next, R, h, cos, sin, qkv);
    }
}

/* final norm + LM head: logits [R, vocab] */
void pd_logits(const ctx_t *ctx, const lin_t *head, const float *ln, int R, const float *h, float *logits) {
    bufs_t bf = buffers(ctx);
#pragma omp parallel num_threads(ctx->threads)
    {
#pragma omp single
        {
            rms(h, ln, bf.a, R, ctx->hidden, ctx->eps);
            prepare_x(head, R, bf.a, bf.b, bf.xsum);
        }
        gemv(head, R, permuted(head) ? bf.b : bf.a, bf.xsum, logits, head->n, 0);
    }
}

/* A whole linear, y [R, n] = x [R, k] W^T + b, for any R: the batched steps' path for INT4 (the
 * weights of each block of rows are read from memory once and reused by every x row while they
 * sit in L1; engine/quant/linear.py's Int4Linear calls it), and the tests' way into every kind. */
void pd_linear(const lin_t *L, int R, const float *x, float *y, int threads) {
    /* x as the kind reads it (permuted, quantized), prepared once before the team: every thread
     * reads all of it */
    const int64_t need = L->aq ? a8_bytes(L, R) : L->kind == W_I8 ? (int64_t)R * L->k * 4 : 0;
    float *buf = malloc((size_t)need + sizeof(float) * (size_t)R);
    if (buf == NULL) abort();
    float *xsum = (float *)((char *)buf + need);
    x = prepare_x(L, R, x, buf, xsum);
#pragma omp parallel num_threads(threads)
    gemv(L, R, x, xsum, y, L->n, 0);
    free(buf);
}

/* An INT4 linear's weights as fp32 [n, k], exactly the values the kernels above apply (the same
 * fused multiply-add), for a prefill-sized step's GEMM. */
void pd_dequant_i4(const lin_t *L, float *out, int threads) {
    const int64_t n = L->n, k = L->k, g = L->group, ng = k / g;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *w = (const uint8_t *)L->w + r * (k / 2);
        float *o = out + r * k, sv[ng], ov[ng];
        row_scales(L, r, 1, sv, ov);
        for (int64_t c = 0; c < k; c += 2 * VW) {
            const float s = sv[c / g], z = ov[c / g];
            for (int i = 0; i < VW; i++) {
                const uint8_t b = w[c / 2 + i];
                o[c + i] = fmaf((float)(b & 15), s, z);
                o[c + VW + i] = fmaf((float)(b >> 4), s, z);
            }
        }
    }
}

/* What this build vectorizes with: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (plain C). */
int pd_vector_width(void) { return VW; }

/* Structured outputs (engine/grammar.py apply_bitmask): logits[rows[r]][t] = -inf wherever bit
 * t % 32 of word t / 32 of bits[r] is 0, for t < vocab (the caller checks words * 32 >= vocab).
 * A word of ones leaves its 32 logits, a word of zeros sets them all: a JSON grammar's masks are
 * words of zeros outside strings and about half mixed words inside one (Qwen2.5's 151,936
 * tokens), so this reads each mask once and writes only what it forbids, 8 lanes a store. torch's
 * masked_fill over the bits expanded to one byte a token took 2-14 ms of a batch-8 step there. */
void pd_mask_logits(float *logits, int64_t ld, const int64_t *rows, int nrows, const uint32_t *bits,
                    int64_t words, int64_t vocab) {
    const float ninf = -INFINITY;
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int r = 0; r < nrows; r++) {
        float *l = logits + rows[r] * ld;
        const uint32_t *b = bits + (int64_t)r * words;
        for (int64_t w = 0; w * 32 < vocab; w++) {
            const uint32_t m = b[w];
            if (m == 0xffffffffu)
                continue;
            const int64_t t0 = w * 32, n = vocab - t0 < 32 ? vocab - t0 : 32;
            if (n == 32) {  /* a byte's 8 bits as 8 lanes: -inf stored where a bit is 0 (AVX2, both builds) */
                for (int k = 0; k < 4; k++) {
                    const uint32_t byte = (m >> (8 * k)) & 0xffu;
                    if (byte == 0xffu)
                        continue;
                    const __m256i hit = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)byte), lane_bit),
                                                           _mm256_setzero_si256());
                    _mm256_maskstore_ps(l + t0 + 8 * k, hit, _mm256_set1_ps(ninf));
                }
                continue;
            }
            for (int64_t j = 0; j < n; j++)
                if (!((m >> j) & 1u))
                    l[t0 + j] = ninf;
        }
    }
}

/* Prefill-sized INT4 / INT8 steps on AMX: its own file, one concept. */
#include "native_amx.c"
