/* Small-step decode, native: one call per layer boundary, reading fp32 or INT8 weights directly.
 *
 * Built at load by engine/models/native.py (gcc -O3 -fopenmp, AVX-512 or AVX2 + FMA as torch
 * dispatches on this CPU) and called through ctypes by engine/models/single_token.py. The math is
 * that of single_token.py's compiled graphs (_pre, _post, _post_pre, _logits), which stay the
 * fallback; attention stays with the eager backend between the calls.
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
 * `group` inputs): w = q * s[n, g] - zero[n, g] * s[n, g] (one FMA: (q - zero) * s), y = x . w
 * + b; stored [N, K/2] in blocks of 2 * VW columns, byte i of a block holding column i in its low
 * nibble and column VW + i in its high one (built by native.py for this library's VW), so that
 * VW bytes widen to two full vectors of weights.
 */
#include <math.h>
#include <stdint.h>
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
#define vset1(f) _mm512_set1_ps(f)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
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
} lin_t;

typedef struct {
    lin_t qkv, o, gu, d;
    const float *ln1, *ln2; /* input norm, post-attention norm */
} layer_t;

typedef struct {
    int64_t hidden, inter, nq, nkv, head_dim, max_rows, threads;
    float eps;
    float *scratch; /* 4 * max_rows * max(hidden, 2 * inter) floats */
} ctx_t;

#define NB 4  /* weight rows per block: independent FMA chains, one weight load for every x row */
/* A block's NB rows are contiguous and so are the next blocks': each row's reader prefetches the
 * same offset PF_AHEAD blocks ahead, a cache line at a time. Without it the packed formats read
 * 13 (INT8) and 10 (INT4) GB/s of weights from memory on a 2-core Xeon where fp32 streams 25: a
 * 16-byte load per 16 weights keeps too few cache misses in flight. Measured there (30 layers +
 * LM head, one token, median of 7 interleaved sweeps), PF_AHEAD 0 (none) / 1 / 2 / 3 / 4: INT8
 * 9.8 / 5.4 / 4.9 / 4.9 / 4.7 ms, INT4 (g32) 8.4 / 5.9 / 5.7 / 5.5 / 5.6, fp32 20.3 / 17.5 / 18.0 /
 * 18.1 / 18.5. */
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#ifndef PF_AHEAD
#define PF_AHEAD 2
#endif
#define RB 4  /* x rows per pass over a weight block (registers: NB * RB accumulators) */

/* out[j][r] = w[j] . x[r] for the block's nb <= NB weight rows and rb <= RB x rows. Inlined with
 * constant nb/rb below so that the accumulators live in registers. */
static inline __attribute__((always_inline)) void
dot_block(const void *w, int64_t k, int kind, int nb, int rb, const float *x, int64_t ldx,
          float out[NB][RB]) {
    vf acc[NB][RB];
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < rb; r++) acc[j][r] = vzero();
    int64_t kv = k - k % VW;
    const int64_t esz = kind == W_I8 ? 1 : 4, row = k * esz;
    for (int64_t c = 0; c < kv; c += VW) {
        if (((c * esz) & 63) == 0)
            for (int j = 0; j < nb; j++) PREFETCH((const char *)w + (PF_AHEAD * NB + j) * row + c * esz);
        vf xr[RB];
        for (int r = 0; r < rb; r++) xr[r] = vload(x + r * ldx + c);
        for (int j = 0; j < nb; j++) {
            vf wv = kind == W_I8 ? vload_i8((const int8_t *)w + j * k + c) : vload((const float *)w + j * k + c);
            for (int r = 0; r < rb; r++) acc[j][r] = vfma(wv, xr[r], acc[j][r]);
        }
    }
    for (int j = 0; j < nb; j++)
        for (int r = 0; r < rb; r++) {
            float t = vsum(acc[j][r]);
            for (int64_t c = kv; c < k; c++) {
                float wc = kind == W_I8 ? (float)((const int8_t *)w)[j * k + c] : ((const float *)w)[j * k + c];
                t += wc * x[r * ldx + c];
            }
            out[j][r] = t;
        }
}

/* INT4: out[j][r] = w[j] . x[r], the weights dequantized in registers a group at a time. */
static inline __attribute__((always_inline)) void
dot_block_i4(const uint8_t *w, const float *s, const float *z, int64_t k, int64_t g, int nb, int rb,
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
         * (one x row): the unpack, not memory, bounded this kernel (it ran 2x faster on 2 threads
         * than on 1). */
        vf tab[NB];
        for (int j = 0; j < nb; j++)
            tab[j] = vfma(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                          vset1(s[j * ng + gi]), vset1(-z[j * ng + gi] * s[j * ng + gi]));
#else
        vf sv[NB], zv[NB];
        for (int j = 0; j < nb; j++) {
            sv[j] = vset1(s[j * ng + gi]);
            zv[j] = vset1(-z[j * ng + gi] * s[j * ng + gi]);
        }
#endif
        for (int64_t c = gi * g; c < (gi + 1) * g; c += 2 * VW) {
            if (((c / 2) & 63) == 0)
                for (int j = 0; j < nb; j++) PREFETCH(w + (PF_AHEAD * NB + j) * (k / 2) + c / 2);
            vf xl[RB], xh[RB];
            for (int r = 0; r < rb; r++) {
                xl[r] = vload(x + r * ldx + c);
                xh[r] = vload(x + r * ldx + c + VW);
            }
            for (int j = 0; j < nb; j++) {
                vf lo, hi;
#if VW == 16
                __m512i v_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + j * (k / 2) + c / 2)));
                lo = _mm512_permutexvar_ps(v_, tab[j]);
                hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v_, 4), tab[j]);
#else
                vload_i4(w + j * (k / 2) + c / 2, lo, hi);
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
        dot_block_i4(w, s, z, k, g, NBV, RBV, x, ldx, out);                                    \
        return;                                                                                \
    }

static void dot_any_i4(const uint8_t *w, const float *s, const float *z, int64_t k, int64_t g, int nb, int rb,
                       const float *x, int64_t ldx, float out[NB][RB]) {
    I4_CASE(4, 1) I4_CASE(4, 2) I4_CASE(4, 3) I4_CASE(4, 4)
    I4_CASE(1, 1) I4_CASE(1, 2) I4_CASE(1, 3) I4_CASE(1, 4)
}

#define DOT_CASE(NBV, RBV)                                                                     \
    if (nb == NBV && rb == RBV) {                                                              \
        if (kind == W_I8) dot_block(w, k, W_I8, NBV, RBV, x, ldx, out);                        \
        else dot_block(w, k, W_F32, NBV, RBV, x, ldx, out);                                    \
        return;                                                                                \
    }

static void dot_any(const void *w, int64_t k, int kind, int nb, int rb, const float *x, int64_t ldx,
                    float out[NB][RB]) {
    DOT_CASE(4, 1) DOT_CASE(4, 2) DOT_CASE(4, 3) DOT_CASE(4, 4)
    DOT_CASE(1, 1) DOT_CASE(1, 2) DOT_CASE(1, 3) DOT_CASE(1, 4)
}

/* y[r, n] (+)= s[n] * (x[r] . w[n]) - zs[n] * xsum[r] + b[n], output rows split over the team.
 * Called inside a parallel region. x [R, k] in the weight's column order; ldy: y's row stride. */
static void gemv(const lin_t *L, int R, const float *x, const float *xsum, float *y, int64_t ldy, int add) {
    const int64_t n = L->n, k = L->k;
    const int64_t wrow = L->kind == W_I8 ? k : L->kind == W_I4 ? k / 2 : 4 * k;
    const int64_t ng = L->kind == W_I4 ? k / L->group : 1;
    const int64_t nblk = (n + NB - 1) / NB;
#pragma omp for schedule(static)
    for (int64_t bi = 0; bi < nblk; bi++) {
        int64_t n0 = bi * NB;
        int nb = n - n0 < NB ? (int)(n - n0) : NB;
        const char *w = (const char *)L->w + n0 * wrow;
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            float out[NB][RB];
            for (int j0 = 0; j0 < nb; j0 += (nb == NB ? NB : 1)) {  /* a tail block: row by row */
                float o1[NB][RB];
                const char *wj = w + j0 * wrow;
                if (L->kind == W_I4)
                    dot_any_i4((const uint8_t *)wj, L->s + (n0 + j0) * ng, L->zs + (n0 + j0) * ng, k, L->group,
                               nb == NB ? NB : 1, rb, x + r0 * k, k, o1);
                else
                    dot_any(wj, k, (int)L->kind, nb == NB ? NB : 1, rb, x + r0 * k, k, o1);
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

/* The activations a linear reads, in its column order (interleave4 for INT8), and their sums. */
static const float *prepare_x(const lin_t *L, int R, const float *x, float *perm, float *xsum) {
    const int64_t k = L->k;
    for (int r = 0; r < R; r++) {
        float s = 0.f;
        for (int64_t c = 0; c < k; c++) s += x[r * k + c];
        xsum[r] = s;
    }
    if (L->kind != W_I8) return x;
    const int64_t k4 = k / 4;
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < k4; i++)
            for (int j = 0; j < 4; j++) perm[r * k + 4 * i + j] = x[r * k + j * k4 + i];
    return perm;
}

/* HF's RMSNorm: w * (x * rsqrt(mean(x^2) + eps)) */
static void rms(const float *x, const float *w, float *out, int R, int64_t h, float eps) {
    for (int r = 0; r < R; r++) {
        float ss = 0.f;
        for (int64_t c = 0; c < h; c++) ss += x[r * h + c] * x[r * h + c];
        float inv = 1.0f / sqrtf(ss / (float)h + eps);
        for (int64_t c = 0; c < h; c++) out[r * h + c] = w[c] * (x[r * h + c] * inv);
    }
}

typedef struct {
    float *a, *b, *c, *xsum;
} bufs_t;

static bufs_t buffers(const ctx_t *ctx) {
    int64_t wide = ctx->hidden > 2 * ctx->inter ? ctx->hidden : 2 * ctx->inter;
    int64_t one = ctx->max_rows * wide;
    bufs_t b = {ctx->scratch, ctx->scratch + one, ctx->scratch + 2 * one, ctx->scratch + 3 * one};
    return b;
}

/* norm + qkv_proj + rotary: qkv [R, nq + 2 nkv, D], q and k rotated; cos/sin [R, D/2]. */
static void pre_in_team(const ctx_t *ctx, const layer_t *L, int R, const float *h, const float *cos,
                        const float *sin, float *qkv) {
    bufs_t bf = buffers(ctx);
    const float *x;
#pragma omp single
    {
        rms(h, L->ln1, bf.a, R, ctx->hidden, ctx->eps);
        prepare_x(&L->qkv, R, bf.a, bf.b, bf.xsum);
    }
    x = L->qkv.kind == W_I8 ? bf.b : bf.a;
    gemv(&L->qkv, R, x, bf.xsum, qkv, L->qkv.n, 0);
#pragma omp single
    {
        const int64_t d = ctx->head_dim, half = d / 2, heads = ctx->nq + ctx->nkv, width = L->qkv.n;
        for (int r = 0; r < R; r++)
            for (int64_t hh = 0; hh < heads; hh++) {
                float *v = qkv + r * width + hh * d;
                const float *cs = cos + r * half, *sn = sin + r * half;
                for (int64_t i = 0; i < half; i++) {
                    float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * cs[i] - x2 * sn[i];
                    v[i + half] = x2 * cs[i] + x1 * sn[i];
                }
            }
    }
}

/* h += o_proj(o); h += down(silu(gate) * up) of norm(h), in place. */
static void post_in_team(const ctx_t *ctx, const layer_t *L, int R, float *h, const float *o) {
    bufs_t bf = buffers(ctx);
    const int64_t hid = ctx->hidden, inter = ctx->inter;
#pragma omp single
    prepare_x(&L->o, R, o, bf.b, bf.xsum);
    gemv(&L->o, R, L->o.kind == W_I8 ? bf.b : o, bf.xsum, h, hid, 1);
#pragma omp single
    {
        rms(h, L->ln2, bf.a, R, hid, ctx->eps);
        prepare_x(&L->gu, R, bf.a, bf.b, bf.xsum);
    }
    gemv(&L->gu, R, L->gu.kind == W_I8 ? bf.b : bf.a, bf.xsum, bf.c, 2 * inter, 0);
#pragma omp single
    {
        for (int r = 0; r < R; r++)
            for (int64_t i = 0; i < inter; i++) {
                float g = bf.c[r * 2 * inter + i], u = bf.c[r * 2 * inter + inter + i];
                bf.a[r * inter + i] = g / (1.0f + expf(-g)) * u;
            }
        prepare_x(&L->d, R, bf.a, bf.b, bf.xsum);
    }
    gemv(&L->d, R, L->d.kind == W_I8 ? bf.b : bf.a, bf.xsum, h, hid, 1);
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
 * over its request's positions 0..pos, read in place from the paged cache [slots, nkv, D]
 * (no gather): softmax in fp32, one (token, query head) pair per work item. o [R, nq * D]. */
static void attend_in_team(const ctx_t *ctx, int R, const float *qkv, int64_t width, const attn_t *at, float *kc,
                           float *vc, float *o) {
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
        const float *q = qkv + t * width + hq * d;
        const int64_t *table = at->tables + t * at->width;
        float acc[256], sc[KCHUNK], m = -INFINITY, l = 0.f;
        for (int64_t c = 0; c < d; c++) acc[c] = 0.f;
        for (int64_t j0 = 0; j0 < n; j0 += KCHUNK) {
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
 * h, then (next != NULL) the next layer's norm + qkv + rotary into qkv. */
void pd_layer(const ctx_t *ctx, const layer_t *L, const layer_t *next, int R, float *h, float *qkv, float *o,
              const float *cos, const float *sin, const attn_t *at, float *kc, float *vc) {
#pragma omp parallel num_threads(ctx->threads)
    {
        attend_in_team(ctx, R, qkv, L->qkv.n, at, kc, vc, o);
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
        gemv(head, R, head->kind == W_I8 ? bf.b : bf.a, bf.xsum, logits, head->n, 0);
    }
}

/* A whole INT4 linear, y [R, n] = x [R, k] W^T + b, for any R: the batched steps' path (the
 * weights of each block of rows are read from memory once and reused by every x row while they
 * sit in L1). Engine/quant/linear.py's Int4Linear calls it. */
void pd_linear_i4(const lin_t *L, int R, const float *x, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    gemv(L, R, x, NULL, y, L->n, 0);
}

/* An INT4 linear's weights as fp32 [n, k], exactly the values the kernels above apply (the same
 * fused multiply-add), for a prefill-sized step's GEMM. */
void pd_dequant_i4(const lin_t *L, float *out, int threads) {
    const int64_t n = L->n, k = L->k, g = L->group, ng = k / g;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *w = (const uint8_t *)L->w + r * (k / 2);
        float *o = out + r * k;
        for (int64_t c = 0; c < k; c += 2 * VW) {
            const float s = L->s[r * ng + c / g], z = -L->zs[r * ng + c / g] * s;
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
