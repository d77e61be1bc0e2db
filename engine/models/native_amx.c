/* Prefill-sized steps of the INT4 and INT8 linears on Intel AMX, in fp32 arithmetic.
 *
 * Included by native_decode.c (the AVX-512 build only: lin_t, row_scales). Where the CPU has
 * AMX-BF16 (engine/models/native.py asks for it: pd_amx_init), a step of many rows multiplies the
 * weight codes, which are small integers and so exact in bf16 (INT4 0..15, INT8 -128..127), by
 * the activations split into three bf16 limbs, x = x1 + x2 + x3, each the next 8 bits of x's
 * 24-bit significand (x1 = x truncated to bf16, x2 = (x - x1) truncated, x3 = the rest, exact).
 * Every product q * x_l is exact in fp32 and the tile unit sums them in fp32, so the group sums
 * P[n, g] = sum_{k in g} q[n, k] x[k] are fp32 dot products of the exact values; then
 * y[n] = b[n] + sum_g (s[n, g] P[n, g] + o[n, g] X[g]), X[g] the group's sum of x: the weight's
 * own arithmetic, w = q * s + o, summed in another order. No input is rounded to bf16: the result
 * is as close to the exact one as an fp32 GEMM over the dequantized weight (the bound is in
 * tests/engine/test_native_amx.py), where a bf16 GEMM would round x to 8 bits. Three tile
 * products per 16x16x32 block instead of an fp32 FMA per weight and row: faster than the fp32
 * GEMM it replaces (numbers: docs/bench/README.md, AMX).
 *
 * Tiles: the weights are the A operand, 16 weight rows x 32 codes as bf16 (row n's codes straight
 * from its packed row, no transpose); the activations the B operand, pairs of consecutive inputs
 * of 16 x rows (packed a chunk at a time into L2, shared by the threads); C[n][m] = y transposed,
 * scaled and accumulated per group in L1 (acc), written to y once per chunk, transposed in
 * registers. Tile
 * registers: 0-3 C for 4 weight blocks (a panel of 64 rows), 4-6 the three limbs of a block of
 * 16 x rows, 7 the weight block being multiplied. */

#if VW == 16 && defined(__GNUC__) && __GNUC__ >= 11
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

/* Linux keeps AMX state off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
 * 1: granted (threads share it), 0: not (no AMX, an old kernel): the caller uses the fp32 GEMM. */
int pd_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

AMX_FN static void amx_config(void) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* bf16 of small integers: the upper half of their fp32 bits (exact: at most 8 significant bits). */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* Rows [16 mb, 16 mb + 16) of x [R, k] (rows past R zero), inputs [32 c0, 32 c1), into xb: per
 * 32 inputs (kk), per limb, one B tile: [16 pairs][16 rows][2] bf16. */
static void amx_pack_x(const float *x, int R, int64_t k, int64_t mb, int64_t c0, int64_t c1, uint16_t *xb) {
    for (int64_t kk = c0; kk < c1; kk++) {
        uint16_t *t = xb + (kk - c0) * 3 * 512;
        for (int i = 0; i < 16; i++) {
            const int64_t m = mb * 16 + i;
            for (int c = 0; c < 32; c++) {
                float v = m < R ? x[m * k + kk * 32 + c] : 0.f, l1, l2;
                uint32_t u, r;
                memcpy(&u, &v, 4);
                u &= 0xffff0000u;
                memcpy(&l1, &u, 4);
                float rest = v - l1;  /* exact: the low 16 bits of the significand */
                memcpy(&r, &rest, 4);
                r &= 0xffff0000u;
                memcpy(&l2, &r, 4);
                float l3 = rest - l2;  /* exact, and at most 8 significant bits */
                const int64_t at = (c / 2) * 32 + i * 2 + (c & 1);
                t[at] = bf16_of(l1);
                t[512 + at] = bf16_of(l2);
                t[1024 + at] = bf16_of(l3);
            }
        }
    }
}

/* xg [ng][rp]: each row's sum over each group of g inputs (rows past R zero). */
static void amx_group_sums(const float *x, int R, int64_t k, int64_t g, float *xg, int threads, int64_t rp) {
    const int64_t ng = k / g;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < rp; m++)
        for (int64_t gi = 0; gi < ng; gi++) {
            float s = 0.f;
            if (m < R)
                for (int64_t c = gi * g; c < (gi + 1) * g; c++) s += x[m * k + c];
            xg[gi * rp + m] = s;
        }
}

/* One weight row's 32 codes from kk on, as 32 bf16 (one A tile row). */
AMX_FN static inline __m512i amx_codes(const lin_t *L, int64_t row, int64_t kk) {
    if (L->kind == W_I4) {  /* 16 bytes: codes c and 16 + c in byte c's low and high nibbles */
        const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)L->w + row * (L->k / 2) + kk * 16));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
        const __m512i tab = _mm512_setr_epi32(0x3f800000, 0x40404000, 0x40a04080, 0x40e040c0, 0x41104100,
                                              0x41304120, 0x41504140, 0x41704160, 0, 0, 0, 0, 0, 0, 0, 0);
        return _mm512_permutexvar_epi16(w, tab);  /* tab's word c: bf16(c) (word 0: +0) */
    }
    const __m256i b = _mm256_loadu_si256((const __m256i *)((const int8_t *)L->w + row * L->k + kk * 32));
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(c, a);  /* exact: integers of at most 8 bits */
}

/* o[i] = column i of the 16 x 16 block a (three rounds of shuffles: 32-bit, 64-bit, 128-bit lanes). */
AMX_FN static inline void amx_transpose(const float (*a)[16], __m512 *o) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(a[i]);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = (__m512)_mm512_unpacklo_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
        r[i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        o[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        o[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

#define AMX_PANEL 4 /* weight blocks of 16 rows per panel: the C tiles 0-3 */
#define AMX_X_L2 (1280 * 1024) /* bytes of x limbs a chunk may hold (a core's L2 is 2 MB here) */
#define AMX_CHUNK_MB 8 /* row blocks a chunk keeps sums for (8 x 4 KB a panel: L1) */

/* Where the sums may stop: INT4 its groups; INT8 (one scale per row) any multiple of 32 inputs
 * that divides k, the largest up to 1536. */
static int64_t amx_group(const lin_t *L) {
    if (L->kind == W_I4) return L->group;
    int64_t d = 48;
    while ((L->k / 32) % d) d--;
    return 32 * d;
}

/* y [R, n] = x W^T + b for an INT4 or INT8 (fp32 activations) linear; n % 16 == 0, k % 32 == 0,
 * INT4 groups a multiple of 32. x in the weight's column order. Each thread packs a panel of 64
 * weight rows (A tiles, in L2) and runs blocks of 16 x rows past it; where all of x's limbs
 * would not fit in L2, in chunks of inputs and rows that do (x's limbs are packed per chunk,
 * the panels again per chunk: cheaper than streaming x from L3 once per panel). */
AMX_FN void pd_amx_linear(const lin_t *L, int R, const float *x, float *y, int threads) {
    const int64_t n = L->n, k = L->k, g = amx_group(L), ng = k / g, nkk = k / 32, gk = g / 32;
    const int64_t mblocks = (R + 15) / 16, rp = mblocks * 16, panels = (n + 16 * AMX_PANEL - 1) / (16 * AMX_PANEL);
    const int64_t sng = L->kind == W_I4 ? ng : 1;  /* scales per row kept */
    int64_t kck = nkk, mcb = mblocks;  /* a chunk: kck inputs / 32, mcb blocks of 16 rows */
    if (mblocks * nkk * 3 * 1024 > AMX_X_L2) {
        kck = (AMX_X_L2 / (3 * 1024 * AMX_CHUNK_MB)) / gk * gk;  /* room for AMX_CHUNK_MB row blocks */
        if (kck < gk) kck = gk;
        if (kck > nkk) kck = nkk;
        mcb = AMX_X_L2 / (kck * 3 * 1024);
        if (mcb < 1) mcb = 1;
    }
    if (mcb > AMX_CHUNK_MB) mcb = AMX_CHUNK_MB;
    uint16_t *xb = aligned_alloc(64, (size_t)(mcb * kck * 3 * 1024));  /* a chunk's limbs */
    float *xg = malloc(sizeof(float) * (size_t)(ng * rp));
    if (xb == NULL || xg == NULL) abort();
    amx_group_sums(x, R, k, g, xg, threads, rp);
    for (int64_t c0 = 0; c0 < nkk; c0 += kck)
        for (int64_t mc = 0; mc < mblocks; mc += mcb) {
            const int64_t c1 = c0 + kck < nkk ? c0 + kck : nkk, mend = mc + mcb < mblocks ? mc + mcb : mblocks;
#pragma omp parallel num_threads(threads)
            {
#pragma omp for schedule(static)
                for (int64_t mb = mc; mb < mend; mb++)  /* the chunk's x, packed where it is used: L2 */
                    amx_pack_x(x, R, k, mb, c0, c1, xb + (mb - mc) * (c1 - c0) * 3 * 512);
                amx_config();
                uint16_t *wa = aligned_alloc(64, (size_t)(kck * AMX_PANEL * 1024));
                float *sv = malloc(sizeof(float) * (size_t)(16 * AMX_PANEL * sng));
                float *ov = malloc(sizeof(float) * (size_t)(16 * AMX_PANEL * sng));
                float (*acc)[16][16] = aligned_alloc(64, sizeof(float) * (size_t)(mcb * AMX_PANEL * 256));  /* [mb][block][n][m] */
                float cb[16][16] __attribute__((aligned(64)));
                if (wa == NULL || sv == NULL || ov == NULL || acc == NULL) abort();
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; p++) {
                    const int64_t n0 = p * 16 * AMX_PANEL;
                    const int nbk = (int)((n - n0) / 16 < AMX_PANEL ? (n - n0) / 16 : AMX_PANEL);
                    for (int j = 0; j < nbk * 16; j++) {  /* the panel's codes in the chunk as A tiles, its scales */
                        for (int64_t kk = c0; kk < c1; kk++)
                            _mm512_store_si512(wa + (((kk - c0) * AMX_PANEL + j / 16) * 16 + j % 16) * 32,
                                               amx_codes(L, n0 + j, kk));
                        if (L->kind == W_I4) row_scales(L, n0 + j, 1, sv + j * ng, ov + j * ng);
                        else sv[j] = L->s[n0 + j], ov[j] = -L->zs[n0 + j];
                    }
                    /* group by group, every row block of the chunk past the group's weight tiles
                     * (in L1 after the first block): only x's tiles stream from L2 */
                    memset(acc, 0, sizeof(float) * (size_t)((mend - mc) * AMX_PANEL * 256));
                    for (int64_t gi = c0 / gk; gi < c1 / gk; gi++) {
                        const int64_t gs = L->kind == W_I4 ? gi : 0;
                        for (int64_t mb = mc; mb < mend; mb++) {
                            float (*ab)[16][16] = acc + (mb - mc) * AMX_PANEL;
                            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                            for (int64_t kk = gi * gk; kk < (gi + 1) * gk; kk++) {
                                const uint16_t *xt = xb + ((mb - mc) * (c1 - c0) + kk - c0) * 3 * 512;
                                const uint16_t *wt = wa + (kk - c0) * AMX_PANEL * 512;
                                _tile_loadd(4, xt, 64);
                                _tile_loadd(5, xt + 512, 64);
                                _tile_loadd(6, xt + 1024, 64);
#define AMX_BLOCK(J)                                                                           \
                                if (J < nbk) {                                                 \
                                    _tile_loadd(7, wt + J * 512, 64);                          \
                                    _tile_dpbf16ps(J, 7, 4);                                   \
                                    _tile_dpbf16ps(J, 7, 5);                                   \
                                    _tile_dpbf16ps(J, 7, 6);                                   \
                                }
                                AMX_BLOCK(0) AMX_BLOCK(1) AMX_BLOCK(2) AMX_BLOCK(3)
#undef AMX_BLOCK
                            }
                            const __m512 xs = _mm512_loadu_ps(xg + gi * rp + mb * 16);
                            for (int j = 0; j < nbk; j++) {
                                switch (j) {  /* tile numbers are immediates */
                                case 0: _tile_stored(0, cb, 64); break;
                                case 1: _tile_stored(1, cb, 64); break;
                                case 2: _tile_stored(2, cb, 64); break;
                                default: _tile_stored(3, cb, 64); break;
                                }
                                for (int r = 0; r < 16; r++) {  /* acc[n][m] += s P + o X */
                                    const int64_t at = (j * 16 + r) * sng + gs;
                                    __m512 a = _mm512_fmadd_ps(_mm512_load_ps(cb[r]), _mm512_set1_ps(sv[at]),
                                                               _mm512_load_ps(ab[j][r]));
                                    _mm512_store_ps(ab[j][r], _mm512_fmadd_ps(_mm512_set1_ps(ov[at]), xs, a));
                                }
                            }
                        }
                    }
                    for (int64_t mb = mc; mb < mend; mb++) {  /* y (+)= acc transposed; + b with the first chunk */
                        float (*ab)[16][16] = acc + (mb - mc) * AMX_PANEL;
                        const int rows = R - mb * 16 < 16 ? (int)(R - mb * 16) : 16;
                        for (int j = 0; j < nbk; j++) {
                            __m512 t[16];
                            amx_transpose(ab[j], t);
                            const int64_t c = n0 + j * 16;
                            const __m512 bv = _mm512_loadu_ps(L->b + c);
                            for (int i = 0; i < rows; i++) {
                                float *d = y + (mb * 16 + i) * n + c;
                                _mm512_storeu_ps(d, _mm512_add_ps(t[i], c0 == 0 ? bv : _mm512_loadu_ps(d)));
                            }
                        }
                    }
                }
                free(wa);
                free(sv);
                free(ov);
                free(acc);
                _tile_release();
            }
        }
    free(xb);
    free(xg);
}
#else
int pd_amx_init(void) { return 0; }
void pd_amx_linear(const lin_t *L, int R, const float *x, float *y, int threads) {
    (void)L; (void)R; (void)x; (void)y; (void)threads;
    abort();  /* never called: pd_amx_init said no */
}
#endif
