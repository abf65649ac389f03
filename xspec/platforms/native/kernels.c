/* Fused host kernels of xspec's CPU platform (see native/__init__.py).
 *
 * Plain C over contiguous float32 buffers: no Python or torch headers, so it builds in
 * well under a second with any C compiler. Built with -ffp-contract=off so every
 * product and sum rounds as the reference torch ops do (no fused multiply-add).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* a . b in 8 independent partial sums (vectorisable; the order differs from a BLAS
 * dot's anyway) */
static float xspec_dot(const float *a, const float *b, int64_t n) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t e = 0;
    for (; e + 8 <= n; e += 8)
        for (int l = 0; l < 8; ++l) lane[l] += a[e + l] * b[e + l];
    float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; e < n; ++e) s += a[e] * b[e];
    return s;
}

/* mHC mixes of one site, T rows at once:
 *   z    = mix * scale[site of column] + base     (mix [T, (2+hc)*hc])
 *   pre  = sigmoid(z[:hc]) + eps                   [T, hc]
 *   post = 2 * sigmoid(z[hc:2hc])                  [T, hc]
 *   comb = Sinkhorn(softmax_rows(z[2hc:]) + eps)   [T, hc, hc]: one column
 *          normalisation, then iters-1 (row, column) rounds, each sum + eps.
 * With x != NULL ([T, hc, d]) also u[t] = sum_i pre[t, i] * x[t, i] ([T, d]). */
void xspec_mhc_pre(const float *mix, const float *scale, const float *base, int64_t rows,
                   int64_t hc, int64_t iters, float eps, const float *x, int64_t d,
                   float *pre, float *post, float *comb, float *u) {
    const int64_t n = (2 + hc) * hc;
    for (int64_t t = 0; t < rows; ++t) {
        const float *m = mix + t * n;
        float *pr = pre + t * hc, *po = post + t * hc, *c = comb + t * hc * hc;
        for (int64_t i = 0; i < hc; ++i) {
            float z = m[i] * scale[0] + base[i];
            pr[i] = 1.0f / (1.0f + expf(-z)) + eps;
            z = m[hc + i] * scale[1] + base[hc + i];
            po[i] = 2.0f * (1.0f / (1.0f + expf(-z)));
        }
        for (int64_t r = 0; r < hc; ++r) {
            float *cr = c + r * hc;
            float mx = -INFINITY;
            for (int64_t j = 0; j < hc; ++j) {
                int64_t k = 2 * hc + r * hc + j;
                cr[j] = m[k] * scale[2] + base[k];
                if (cr[j] > mx) mx = cr[j];
            }
            float s = 0.0f;
            for (int64_t j = 0; j < hc; ++j) {
                cr[j] = expf(cr[j] - mx);
                s += cr[j];
            }
            for (int64_t j = 0; j < hc; ++j) cr[j] = cr[j] / s + eps;
        }
        for (int64_t it = 0; it < iters; ++it) {
            if (it > 0) {
                for (int64_t r = 0; r < hc; ++r) {
                    float s = 0.0f;
                    for (int64_t j = 0; j < hc; ++j) s += c[r * hc + j];
                    s += eps;
                    for (int64_t j = 0; j < hc; ++j) c[r * hc + j] /= s;
                }
            }
            for (int64_t j = 0; j < hc; ++j) {
                float s = 0.0f;
                for (int64_t r = 0; r < hc; ++r) s += c[r * hc + j];
                s += eps;
                for (int64_t r = 0; r < hc; ++r) c[r * hc + j] /= s;
            }
        }
        if (x != 0) {
            const float *xt = x + t * hc * d;
            float *ut = u + t * d;
            for (int64_t k = 0; k < d; ++k) ut[k] = pr[0] * xt[k];
            for (int64_t i = 1; i < hc; ++i)
                for (int64_t k = 0; k < d; ++k) ut[k] += pr[i] * xt[i * d + k];
        }
    }
}

/* Weighted (w != NULL) or plain RMS normalisation of each row of x [rows, n]:
 * y = x * (1 / sqrt(mean(x^2) + eps)) * w. */
void xspec_rms_norm(const float *x, const float *w, int64_t rows, int64_t n, float eps,
                    float *y) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float inv = 1.0f / sqrtf(xspec_dot(xr, xr, n) / (float)n + eps);
        if (w != 0)
            for (int64_t k = 0; k < n; ++k) yr[k] = (xr[k] * inv) * w[k];
        else
            for (int64_t k = 0; k < n; ++k) yr[k] = xr[k] * inv;
    }
}

/* RoPE on the last rd dims of every head: x [rows, heads, d] -> y (same shape; the
 * other dims copied). cos, sin [rows, rd] interleaved as xspec's Rope tables: pair
 * (2i, 2i+1) has cos (c, c) and sin (-s, s). Forward: y = rope*cos + swap(rope)*sin;
 * inverse: y = rope*cos - swap(rope)*sin (the same products and sums as rope.rotate). */
void xspec_rope(const float *x, const float *cos, const float *sin, int64_t rows,
                int64_t heads, int64_t d, int64_t rd, int64_t inverse, float *y) {
    const int64_t keep = d - rd;
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos + r * rd, *s = sin + r * rd;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xh = x + (r * heads + h) * d;
            float *yh = y + (r * heads + h) * d;
            for (int64_t k = 0; k < keep; ++k) yh[k] = xh[k];
            const float *a = xh + keep;
            float *o = yh + keep;
            for (int64_t k = 0; k < rd; k += 2) {
                float p = a[k] * c[k], q = a[k + 1] * s[k];
                float p1 = a[k + 1] * c[k + 1], q1 = a[k] * s[k + 1];
                o[k] = inverse ? p - q : p + q;
                o[k + 1] = inverse ? p1 - q1 : p1 + q1;
            }
        }
    }
}

/* The lightning indexer's top-k for each query row t (see compressor.Indexer.select):
 *   score[j] = sum_h w[t, h] * (relu(q[t, h] . keys[key0[t] + j]) * scale),  j < visible[t]
 * (entries j >= visible[t] and NaN scores rank as -inf). The k entries of largest score
 * among j < n, exact ties to the lower index, are written in ascending index order to
 * out[t, :k], each -1 where its score is -inf. q [T, H, c], w [T, H], keys [nkeys, c].
 * scratch: n floats. Returns 1 (out unfinished) if a row's keys key0[t] .. key0[t] +
 * visible[t] are not all within the nkeys rows (or either is negative), else 0. */
static int xspec_before(float sa, int64_t a, float sb, int64_t b) {
    return sa > sb || (sa == sb && a < b); /* a ranks before b */
}

int64_t xspec_index_topk(const float *q, const float *w, const float *keys, int64_t nkeys,
                         const int64_t *key0, const int64_t *visible, int64_t rows,
                         int64_t heads, int64_t c, int64_t n, int64_t k, float scale,
                         float *score, int64_t *heap, int64_t *out) {
    for (int64_t t = 0; t < rows; ++t)
        if (key0[t] < 0 || visible[t] < 0 || key0[t] > nkeys - visible[t]) return 1;
    for (int64_t t = 0; t < rows; ++t) {
        const float *base = keys + key0[t] * c;
        int64_t vis = visible[t] < n ? visible[t] : n;
        for (int64_t j = 0; j < n; ++j) {
            if (j >= vis) {
                score[j] = -INFINITY;
                continue;
            }
            const float *kj = base + j * c;
            float s = 0.0f;
            for (int64_t h = 0; h < heads; ++h) {
                const float *qh = q + (t * heads + h) * c;
                float dot = xspec_dot(qh, kj, c);
                float r = dot < 0.0f ? 0.0f : dot; /* relu, NaN stays NaN */
                s += (r * scale) * w[t * heads + h];
            }
            score[j] = isnan(s) ? -INFINITY : s;
        }
        /* min-heap (by rank) of the best k seen: heap[0] ranks last among them */
        int64_t size = 0;
        for (int64_t j = 0; j < n; ++j) {
            if (size < k) {
                int64_t i = size++;
                heap[i] = j;
                while (i > 0) { /* sift up: a worse-ranked entry moves to the root */
                    int64_t p = (i - 1) / 2;
                    if (!xspec_before(score[heap[p]], heap[p], score[heap[i]], heap[i])) break;
                    int64_t tmp = heap[p];
                    heap[p] = heap[i];
                    heap[i] = tmp;
                    i = p;
                }
            } else if (xspec_before(score[j], j, score[heap[0]], heap[0])) {
                heap[0] = j;
                int64_t i = 0;
                for (;;) { /* sift down */
                    int64_t l = 2 * i + 1, r = l + 1, m = i;
                    if (l < size && xspec_before(score[heap[m]], heap[m], score[heap[l]], heap[l]))
                        m = l;
                    if (r < size && xspec_before(score[heap[m]], heap[m], score[heap[r]], heap[r]))
                        m = r;
                    if (m == i) break;
                    int64_t tmp = heap[m];
                    heap[m] = heap[i];
                    heap[i] = tmp;
                    i = m;
                }
            }
        }
        /* the chosen entries in ascending index order (insertion sort: k is small) */
        for (int64_t i = 1; i < size; ++i) {
            int64_t v = heap[i], p = i - 1;
            while (p >= 0 && heap[p] > v) {
                heap[p + 1] = heap[p];
                --p;
            }
            heap[p + 1] = v;
        }
        int64_t *o = out + t * k, m = 0;
        for (int64_t i = 0; i < size; ++i) o[m++] = score[heap[i]] == -INFINITY ? -1 : heap[i];
        for (; m < k; ++m) o[m] = -1;
    }
    return 0;
}

/* XSPEC_LANES floats as one value (GCC / clang vector extension): the width of one
 * vector register, 8 with AVX, else 4 (SSE, NEON). */
#if defined(__AVX__)
#define XSPEC_LANES 8
#else
#define XSPEC_LANES 4
#endif
typedef float xspec_vec __attribute__((vector_size(4 * XSPEC_LANES)));

static inline xspec_vec xspec_load(const float *p) {
    xspec_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float xspec_hsum(xspec_vec v) {
    float s = 0.0f;
    for (int c = 0; c < XSPEC_LANES; ++c) s += v[c];
    return s;
}

/* The dense products below (attention, experts) may fuse multiply-adds, as the BLAS
 * the reference ops call does; the kernels above stay exact to the reference ops. */
#if defined(__GNUC__) && !defined(__clang__)
#define XSPEC_DENSE __attribute__((optimize("fp-contract=fast")))
#else
#define XSPEC_DENSE
#endif

/* y = W x for W [m, n]: blocks of 4 rows of W with vector accumulators */
XSPEC_DENSE static void xspec_gemv(const float *w, const float *x, int64_t m, int64_t n,
                                   float *y) {
    int64_t nv = n - n % XSPEC_LANES, i = 0;
    for (; i + 4 <= m; i += 4) {
        const float *w0 = w + i * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        xspec_vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t e = 0; e < nv; e += XSPEC_LANES) {
            xspec_vec xv = xspec_load(x + e);
            a0 += xspec_load(w0 + e) * xv;
            a1 += xspec_load(w1 + e) * xv;
            a2 += xspec_load(w2 + e) * xv;
            a3 += xspec_load(w3 + e) * xv;
        }
        float s0 = xspec_hsum(a0), s1 = xspec_hsum(a1), s2 = xspec_hsum(a2), s3 = xspec_hsum(a3);
        for (int64_t e = nv; e < n; ++e) {
            s0 += w0[e] * x[e];
            s1 += w1[e] * x[e];
            s2 += w2[e] * x[e];
            s3 += w3[e] * x[e];
        }
        y[i] = s0;
        y[i + 1] = s1;
        y[i + 2] = s2;
        y[i + 3] = s3;
    }
    for (; i < m; ++i) {
        float acc = 0.0f;
        for (int64_t e = 0; e < n; ++e) acc += w[i * n + e] * x[e];
        y[i] = acc;
    }
}

/* logit[j, h] = scale * (q[h] . rows[j]) for n rows and H heads, q transposed to
 * qt [D, H]: blocks of 4 rows x XSPEC_LANES heads in registers (independent chains, no
 * horizontal sums); the rest one at a time. */
XSPEC_DENSE static void xspec_logits(const float *qt, const float *const *rows, int64_t n,
                                     int64_t heads, int64_t d, float scale, float *logit) {
    int64_t hv = heads - heads % XSPEC_LANES, j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *r0 = rows[j], *r1 = rows[j + 1], *r2 = rows[j + 2], *r3 = rows[j + 3];
        for (int64_t h0 = 0; h0 < hv; h0 += XSPEC_LANES) {
            xspec_vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t e = 0; e < d; ++e) {
                xspec_vec qe = xspec_load(qt + e * heads + h0);
                a0 += qe * r0[e];
                a1 += qe * r1[e];
                a2 += qe * r2[e];
                a3 += qe * r3[e];
            }
            for (int c = 0; c < XSPEC_LANES; ++c) {
                logit[j * heads + h0 + c] = scale * a0[c];
                logit[(j + 1) * heads + h0 + c] = scale * a1[c];
                logit[(j + 2) * heads + h0 + c] = scale * a2[c];
                logit[(j + 3) * heads + h0 + c] = scale * a3[c];
            }
        }
    }
    for (int64_t r = 0; r < n; ++r)
        for (int64_t h = r < j ? hv : 0; h < heads; ++h) {
            float acc = 0.0f;
            for (int64_t e = 0; e < d; ++e) acc += qt[e * heads + h] * rows[r][e];
            logit[r * heads + h] = scale * acc;
        }
}

/* out[h] = sum_j p[j, h] * rows[j] for each head: 2 heads x 4 * XSPEC_LANES dims in
 * registers (each row block loaded once for both heads); the rest one at a time. */
XSPEC_DENSE static void xspec_weighted_rows(const float *p, const float *const *rows,
                                            int64_t n, int64_t heads, int64_t d, float *out) {
    enum { B = 4 * XSPEC_LANES };
    int64_t dv = d - d % B, h = 0;
    for (; h + 2 <= heads; h += 2) {
        float *o0 = out + h * d, *o1 = o0 + d;
        for (int64_t e0 = 0; e0 < dv; e0 += B) {
            xspec_vec a[4] = {{0}, {0}, {0}, {0}}, b[4] = {{0}, {0}, {0}, {0}};
            for (int64_t j = 0; j < n; ++j) {
                float w0 = p[j * heads + h], w1 = p[j * heads + h + 1];
                const float *r = rows[j] + e0;
                for (int c = 0; c < 4; ++c) {
                    xspec_vec v = xspec_load(r + c * XSPEC_LANES);
                    a[c] += v * w0;
                    b[c] += v * w1;
                }
            }
            memcpy(o0 + e0, a, sizeof a);
            memcpy(o1 + e0, b, sizeof b);
        }
    }
    for (int64_t hh = 0; hh < heads; ++hh) /* the dims past the blocks; an odd last head */
        for (int64_t e = hh < h ? dv : 0; e < d; ++e) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n; ++j) acc += p[j * heads + hh] * rows[j][e];
            out[hh * d + e] = acc;
        }
}

/* exp(x) of each lane: 2^k * exp(r), k = round(x / ln 2), r = x - k ln 2 (in two parts),
 * exp(r) by Cephes' degree-6 polynomial (within 2 ulp of expf); x is clamped to
 * [-87.3, 88.7], and below -87.3 (-inf included: a masked logit, a -inf sink) the result
 * is 0 (expf gives 0 or a subnormal there). NaN stays NaN. */
typedef int32_t xspec_ivec __attribute__((vector_size(4 * XSPEC_LANES)));

static inline xspec_vec xspec_select(xspec_ivec mask, xspec_vec a, xspec_vec b) {
    return (xspec_vec)((mask & (xspec_ivec)a) | (~mask & (xspec_ivec)b));
}

static inline xspec_vec xspec_vexp(xspec_vec x0) {
    /* the constants as vectors (not x - x + c: that is NaN for an infinite x) */
    const xspec_vec zero = {0}, hi = zero + 88.7f, lo = zero + -87.3f, magic = zero + 12582912.0f;
    xspec_vec x = xspec_select(x0 > hi, hi, x0);
    x = xspec_select(x < lo, lo, x);
    xspec_vec t = x * 1.44269504088896341f + magic; /* k in the low mantissa bits */
    xspec_vec k = t - magic;
    xspec_vec r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    xspec_vec y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    xspec_ivec e = ((xspec_ivec)t - (xspec_ivec)magic + 127) << 23; /* 2^k */
    return xspec_select(x0 < lo, zero, y * (xspec_vec)e);
}

/* In place, per head h: logit[:, h] <- softmax of (logit[0..n-1, h], sink[h]) without the
 * sink's own term, for logit [n, H]: blocks of XSPEC_LANES heads as vectors. */
static void xspec_softmax_heads(float *logit, int64_t n, int64_t heads, const float *sink) {
    int64_t hv = heads - heads % XSPEC_LANES;
    for (int64_t h0 = 0; h0 < hv; h0 += XSPEC_LANES) {
        xspec_vec m = xspec_load(sink + h0);
        for (int64_t j = 0; j < n; ++j) {
            xspec_vec l = xspec_load(logit + j * heads + h0);
            m = xspec_select(l > m, l, m);
        }
        xspec_vec sum = xspec_vexp(xspec_load(sink + h0) - m);
        for (int64_t j = 0; j < n; ++j) {
            xspec_vec p = xspec_vexp(xspec_load(logit + j * heads + h0) - m);
            memcpy(logit + j * heads + h0, &p, sizeof p);
            sum += p;
        }
        for (int64_t j = 0; j < n; ++j) {
            xspec_vec p = xspec_load(logit + j * heads + h0) / sum;
            memcpy(logit + j * heads + h0, &p, sizeof p);
        }
    }
    for (int64_t h = hv; h < heads; ++h) {
        float m = sink[h], sum;
        for (int64_t j = 0; j < n; ++j)
            if (logit[j * heads + h] > m) m = logit[j * heads + h];
        sum = expf(sink[h] - m);
        for (int64_t j = 0; j < n; ++j) {
            float p = expf(logit[j * heads + h] - m);
            logit[j * heads + h] = p;
            sum += p;
        }
        for (int64_t j = 0; j < n; ++j) logit[j * heads + h] /= sum;
    }
}

/* Sparse attention with a value-less sink (attention.sparse_attention), S queries at once.
 * Query s attends the rows its index rows select from up to two sources: rows
 * idx0[s, :k0] of kv0 [*, D], then rows idx1[s, :k1] of kv1 (-1 = none; k1 may be 0).
 * Per head h: logit_j = scale * (q[s, h] . row_j), p = softmax({logit_j} and sink[h]),
 * the sink in the denominator only; out[s, h] = sum_j p_j * row_j.
 * q, out [S, H, D]; scratch: (k0 + k1 + D) * H floats and k0 + k1 row pointers.
 * Returns 1 (out unfinished) if an index is out of its source's n0 / n1 rows, else 0. */
int64_t xspec_sparse_attn(const float *q, int64_t nq, int64_t heads, int64_t d,
                          const float *kv0, int64_t n0, const int64_t *idx0, int64_t k0,
                          const float *kv1, int64_t n1, const int64_t *idx1, int64_t k1,
                          const float *sink, float scale, float *scratch, const float **rows,
                          float *out) {
    float *logit = scratch, *qt = scratch + (k0 + k1) * heads; /* [K, H], [D, H] */
    for (int64_t s = 0; s < nq; ++s) {
        const float *qs = q + s * heads * d;
        int64_t n = 0; /* the selected rows, in index order (masked ones skipped) */
        for (int64_t j = 0; j < k0; ++j) {
            int64_t r = idx0[s * k0 + j];
            if (r >= n0) return 1;
            if (r >= 0) rows[n++] = kv0 + r * d;
        }
        for (int64_t j = 0; j < k1; ++j) {
            int64_t r = idx1[s * k1 + j];
            if (r >= n1) return 1;
            if (r >= 0) rows[n++] = kv1 + r * d;
        }
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t e = 0; e < d; ++e) qt[e * heads + h] = qs[h * d + e];
        xspec_logits(qt, rows, n, heads, d, scale, logit);
        xspec_softmax_heads(logit, n, heads, sink);
        xspec_weighted_rows(logit, rows, n, heads, d, out + s * heads * d);
    }
    return 0;
}

/* Y[r, i] = W[i] . X[r] for W [m, n] and rows X[r] (pointers), r < R: blocks of 4 rows
 * of W x 2 rows of X share their loads. Each dot is summed exactly as xspec_gemv sums it,
 * so a row's result does not depend on the rows it is blocked with. Y [R, m]. */
XSPEC_DENSE static void xspec_gemm_rows(const float *w, int64_t m, int64_t n,
                                        const float *const *x, int64_t rows, float *y) {
    int64_t nv = n - n % XSPEC_LANES, r = 0;
    for (; r + 2 <= rows; r += 2) {
        const float *x0 = x[r], *x1 = x[r + 1];
        float *y0 = y + r * m, *y1 = y0 + m;
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
            const float *w0 = w + i * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
            xspec_vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            xspec_vec b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int64_t e = 0; e < nv; e += XSPEC_LANES) {
                xspec_vec u = xspec_load(x0 + e), v = xspec_load(x1 + e);
                xspec_vec c0 = xspec_load(w0 + e), c1 = xspec_load(w1 + e);
                xspec_vec c2 = xspec_load(w2 + e), c3 = xspec_load(w3 + e);
                a0 += c0 * u;
                a1 += c1 * u;
                a2 += c2 * u;
                a3 += c3 * u;
                b0 += c0 * v;
                b1 += c1 * v;
                b2 += c2 * v;
                b3 += c3 * v;
            }
            float s[8] = {xspec_hsum(a0), xspec_hsum(a1), xspec_hsum(a2), xspec_hsum(a3),
                          xspec_hsum(b0), xspec_hsum(b1), xspec_hsum(b2), xspec_hsum(b3)};
            for (int64_t e = nv; e < n; ++e)
                for (int c = 0; c < 4; ++c) {
                    s[c] += w[(i + c) * n + e] * x0[e];
                    s[4 + c] += w[(i + c) * n + e] * x1[e];
                }
            for (int c = 0; c < 4; ++c) {
                y0[i + c] = s[c];
                y1[i + c] = s[4 + c];
            }
        }
        for (; i < m; ++i) { /* as xspec_gemv's last rows */
            float s0 = 0.0f, s1 = 0.0f;
            for (int64_t e = 0; e < n; ++e) {
                s0 += w[i * n + e] * x0[e];
                s1 += w[i * n + e] * x1[e];
            }
            y0[i] = s0;
            y1[i] = s1;
        }
    }
    for (; r < rows; ++r) xspec_gemv(w, x[r], m, n, y + r * m);
}

/* One routed MoE layer on T rows (moe.MoE.forward), expert weights stacked by group:
 * gate: logit_e = x . gate_w[e]; score = softmax (score_fn 0), sigmoid (1) or
 * sqrt(softplus) (2); the row's k experts are table[ids[t], :] (hash layers, table !=
 * NULL) or the k largest score + bias (ties to the lower id), weighted by their scores,
 * normalised to sum 1 if norm (summed in rank order), times scaling. Then
 * y[t] = sum over its experts in ascending id of W2_e (w_e * silu(min(W1_e x, L)) *
 * clamp(W3_e x, -L, L)) (no clamps when L <= 0), plus the shared expert (stack row E,
 * weight 1) last when shared != 0. The experts run one after another on all their rows
 * (xspec_gemm_rows), adding to y in ascending id: each row's sum keeps that order.
 * x, y [T, d]; gate_w [E, d]; bias [E] or NULL; w1, w3 [G, inter, d]; w2 [G, d, inter];
 * scratch: 2 * E + A + 3 * A * inter + A * d floats (A = T * k, at least T), A int64,
 * 2 * A pointers; pick: T * k int64. Returns 1 (y unwritten) if a hash layer's token id
 * or table entry is out of range, else 0. */
static float xspec_silu(float g) { return g / (1.0f + expf(-g)); }

int64_t xspec_moe(const float *x, const int64_t *ids, int64_t rows, int64_t d, int64_t inter,
                  const float *gate_w, const float *bias, const int64_t *table,
                  int64_t table_rows, int64_t experts, int64_t k, int64_t score_fn,
                  int64_t norm, float scaling, float limit, const float *w1, const float *w2,
                  const float *w3, int64_t shared, float *scratch, int64_t *pick,
                  int64_t *members, const float **ptrs, float *y) {
    int64_t most = rows * k > rows ? rows * k : rows; /* rows one expert may have */
    float *score = scratch, *biased = score + experts, *weight = biased + experts;
    float *g = weight + rows * k, *u = g + most * inter, *h = u + most * inter;
    float *out = h + most * inter;
    const float **xs = ptrs, **hs = ptrs + most;
    /* routing: each row's k experts (rank order) and their weights */
    for (int64_t t = 0; t < rows; ++t) {
        const float *xt = x + t * d;
        int64_t *pt = pick + t * k;
        for (int64_t e = 0; e < experts; ++e) score[e] = xspec_dot(gate_w + e * d, xt, d);
        if (score_fn == 0) {
            float m = score[0], sum = 0.0f;
            for (int64_t e = 1; e < experts; ++e)
                if (score[e] > m) m = score[e];
            for (int64_t e = 0; e < experts; ++e) {
                score[e] = expf(score[e] - m);
                sum += score[e];
            }
            for (int64_t e = 0; e < experts; ++e) score[e] /= sum;
        } else {
            for (int64_t e = 0; e < experts; ++e) {
                float l = score[e];
                score[e] = score_fn == 1 ? 1.0f / (1.0f + expf(-l))
                                         : sqrtf(l > 20.0f ? l : log1pf(expf(l)));
            }
        }
        if (table != 0) {
            if (ids[t] < 0 || ids[t] >= table_rows) return 1;
            for (int64_t i = 0; i < k; ++i) {
                pt[i] = table[ids[t] * k + i];
                if (pt[i] < 0 || pt[i] >= experts) return 1;
            }
        } else { /* selection: the k best biased scores, in rank order */
            for (int64_t e = 0; e < experts; ++e) biased[e] = bias ? score[e] + bias[e] : score[e];
            for (int64_t i = 0; i < k; ++i) {
                int64_t best = -1;
                for (int64_t e = 0; e < experts; ++e) {
                    int taken = 0;
                    for (int64_t p = 0; p < i; ++p) taken |= pt[p] == e;
                    if (!taken && (best < 0 || biased[e] > biased[best])) best = e;
                }
                pt[i] = best;
            }
        }
        float sum = 0.0f;
        for (int64_t i = 0; i < k; ++i) sum += score[pt[i]];
        for (int64_t i = 0; i < k; ++i)
            weight[t * k + i] = (norm ? score[pt[i]] / sum : score[pt[i]]) * scaling;
    }
    for (int64_t j = 0; j < rows * d; ++j) y[j] = 0.0f;
    /* each expert on its assignments (row-major order), then the shared one on every row */
    for (int64_t e = 0; e < experts + (shared ? 1 : 0); ++e) {
        int64_t n = 0;
        if (e < experts) {
            for (int64_t a = 0; a < rows * k; ++a)
                if (pick[a] == e) members[n++] = a;
        } else {
            for (int64_t t = 0; t < rows; ++t) members[n++] = -1 - t; /* shared: weight 1 */
        }
        if (n == 0) continue;
        for (int64_t r = 0; r < n; ++r) {
            int64_t t = members[r] >= 0 ? members[r] / k : -1 - members[r];
            xs[r] = x + t * d;
            hs[r] = h + r * inter;
        }
        const float *e1 = w1 + e * inter * d, *e3 = w3 + e * inter * d, *e2 = w2 + e * d * inter;
        xspec_gemm_rows(e1, inter, d, xs, n, g);
        xspec_gemm_rows(e3, inter, d, xs, n, u);
        for (int64_t r = 0; r < n; ++r)
            for (int64_t i = 0; i < inter; ++i) {
                float gi = g[r * inter + i], ui = u[r * inter + i];
                if (limit > 0.0f) {
                    gi = gi > limit ? limit : gi;
                    ui = ui > limit ? limit : (ui < -limit ? -limit : ui);
                }
                float act = xspec_silu(gi) * ui;
                h[r * inter + i] = members[r] >= 0 ? weight[members[r]] * act : act;
            }
        xspec_gemm_rows(e2, d, inter, hs, n, out);
        for (int64_t r = 0; r < n; ++r) {
            int64_t t = members[r] >= 0 ? members[r] / k : -1 - members[r];
            for (int64_t j = 0; j < d; ++j) y[t * d + j] += out[r * d + j];
        }
    }
    return 0;
}

/* A compressor's softmax pooling of the windows one forward completes
 * (compressor.Compressor.pool), E entries at once. Row r of source = ring [R, 2*cw] for
 * r < R, else rows [T, 2*cw] (r - R) for r < R + T, else the pad row (kv 0, score -inf:
 * weight 0), where a row is [kv | score], cw = coff * width. Entry e pools its coff * m
 * rows index[e, :]: with coff 2 the first m rows give their first width channels (and
 * scores), the last m their second; per channel p = softmax over the rows of score,
 * out[e] = sum_rows p * kv. out [E, width]; scratch: coff * m floats. Returns 1 (out
 * unwritten) if an index is outside the rows and the pad row, else 0. */
int64_t xspec_compress_pool(const float *ring, int64_t ring_rows, const float *rows,
                            int64_t new_rows, const int64_t *index, int64_t entries,
                            int64_t m, int64_t coff, int64_t width, float *scratch,
                            float *out) {
    int64_t span = coff * m, cw = coff * width;
    for (int64_t i = 0; i < entries * span; ++i)
        if (index[i] < 0 || index[i] > ring_rows + new_rows) return 1;
    for (int64_t e = 0; e < entries; ++e) {
        const int64_t *ix = index + e * span;
        for (int64_t c = 0; c < width; ++c) {
            float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
            for (int64_t i = 0; i < span; ++i) { /* this channel's score in each row */
                int64_t r = ix[i], col = (i / m) * width + c;
                const float *row = r < ring_rows ? ring + r * 2 * cw
                                   : r < ring_rows + new_rows ? rows + (r - ring_rows) * 2 * cw
                                                              : 0;
                scratch[i] = row ? row[cw + col] : -INFINITY;
                if (scratch[i] > mx) mx = scratch[i];
            }
            for (int64_t i = 0; i < span; ++i) {
                scratch[i] = expf(scratch[i] - mx);
                sum += scratch[i];
            }
            for (int64_t i = 0; i < span; ++i) {
                int64_t r = ix[i], col = (i / m) * width + c;
                if (r >= ring_rows + new_rows) continue; /* the pad row: weight 0 */
                const float *row =
                    r < ring_rows ? ring + r * 2 * cw : rows + (r - ring_rows) * 2 * cw;
                acc += row[col] * (scratch[i] / sum);
            }
            out[e * width + c] = acc;
        }
    }
    return 0;
}

/* W8A8 dynamic linear (the "native" semantics of models/quantized.py), reading the int8
 * weight as stored: y[t, j] = ((float)(xq[t] . w[j]) * xs[t]) * ws[j], the dot product of
 * int8 codes accumulated exactly in int32 (|acc| < 2^31 for k < 133000). xq [rows, k]
 * int8 per-token codes, xs [rows] their scales, w [n, k] int8, ws [n] per-channel scales,
 * y [rows, n] fp32. Each weight row is read once for all rows (decode / verify sizes). */
void xspec_w8a8_linear(const int8_t *xq, const float *xs, const int8_t *w, const float *ws,
                       int64_t rows, int64_t n, int64_t k, float *y) {
    for (int64_t j = 0; j < n; ++j) {
        const int8_t *wr = w + j * k;
        for (int64_t t = 0; t < rows; ++t) {
            const int8_t *xr = xq + t * k;
            int32_t acc = 0;
            for (int64_t i = 0; i < k; ++i) acc += (int32_t)xr[i] * (int32_t)wr[i];
            y[t * n + j] = ((float)acc * xs[t]) * ws[j];
        }
    }
}

/* FP8 / MXFP4 linear with the "native" semantics of models/quantized.py (e4m3
 * activations in per-token blocks of 128), decoding the stored weight bytes row by row:
 *   y[t, j] = sum_b (xd[t, b-block] . wrow[b-block]) * xs[t, b]
 * xd [rows, k]: the activations' e4m3 values (decoded, unscaled); xs [rows, k/128] their
 * block scales; wrow: weight row j decoded to fp32 exactly as the reference dequantizes
 * it (fmt 0, FP8: lut[w[j, i]] * ws[j / 128, i / 128], ws [ceil(n/128), k/128];
 * fmt 1, MXFP4: e2m1 codes, low nibble = even column, times ws[j, i / 32], ws [n, k/32]).
 * lut: the 256 e4m3 values (fmt 0) or the 16 e2m1 values (fmt 1). scratch: k floats.
 * Rows are independent; sums differ from a BLAS GEMM's only in their order. */
void xspec_lowbit_linear(const float *xd, const float *xs, const uint8_t *w, const float *ws,
                         const float *lut, int64_t fmt, int64_t rows, int64_t n, int64_t k,
                         float *scratch, float *y) {
    const int64_t kb = k / 128;
    for (int64_t j = 0; j < n; ++j) {
        if (fmt == 0) {
            const uint8_t *wr = w + j * k;
            const float *sw = ws + (j / 128) * kb;
            for (int64_t b = 0; b < kb; ++b) {  /* one scale per 128 columns */
                const float s = sw[b];
                const uint8_t *src = wr + b * 128;
                float *dst = scratch + b * 128;
                for (int i = 0; i < 128; ++i) dst[i] = lut[src[i]] * s;
            }
        } else {
            const uint8_t *wr = w + j * (k / 2);
            const float *sw = ws + j * (k / 32);
            for (int64_t g = 0; g < k / 32; ++g) {  /* one scale per 32 columns: 16 bytes */
                const float s = sw[g];
                const uint8_t *src = wr + g * 16;
                float *dst = scratch + g * 32;
                for (int i = 0; i < 16; ++i) {
                    dst[2 * i] = lut[src[i] & 15] * s;
                    dst[2 * i + 1] = lut[src[i] >> 4] * s;
                }
            }
        }
        for (int64_t t = 0; t < rows; ++t) {
            const float *xr = xd + t * k, *sx = xs + t * kb;
            float acc = 0.0f;
            for (int64_t b = 0; b < kb; ++b)
                acc += xspec_dot(xr + b * 128, scratch + b * 128, 128) * sx[b];
            y[t * n + j] = acc;
        }
    }
}
