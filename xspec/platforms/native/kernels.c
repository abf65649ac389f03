/* Fused host kernels of xspec's CPU platform (see native/__init__.py).
 *
 * Plain C over contiguous float32 buffers: no Python or torch headers, so it builds in
 * well under a second with any C compiler. Built with -ffp-contract=off so every
 * product and sum rounds as the reference torch ops do (no fused multiply-add).
 */
#include <math.h>
#include <stdint.h>

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
 * out[t, :k], each -1 where its score is -inf. q [T, H, c], w [T, H], keys [*, c].
 * scratch: n floats. */
static int xspec_before(float sa, int64_t a, float sb, int64_t b) {
    return sa > sb || (sa == sb && a < b); /* a ranks before b */
}

void xspec_index_topk(const float *q, const float *w, const float *keys, const int64_t *key0,
                      const int64_t *visible, int64_t rows, int64_t heads, int64_t c,
                      int64_t n, int64_t k, float scale, float *score, int64_t *heap,
                      int64_t *out) {
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
}
