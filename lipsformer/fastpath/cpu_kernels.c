/* LipsFormer's CPU kernels that PyTorch lacks, on NHWC (channels-last) float32 tensors; compiled and loaded by
   lipsformer.fastpath.native, called from lipsformer/fastpath (depthwise_conv.py, lean_autograd.py).

   1. The weight gradient of a stride-1, 'same'-padded 7x7 depthwise convolution, per image (the caller sums):

          dW[b][c][i][j] = sum_{h, w} g[b, h, w, c] x[b, h + i - 3, w + j - 3, c]      (x zero outside the map)

      oneDNN has no fast kernel for it. A thread takes (image, block of CB channels) items; for each output row h
      and kernel row i it slides a window of seven x vectors along the row, so each step loads one x vector and one
      g vector for seven multiply-adds, all in registers.

   2. The backward of the conv shortcuts' residual out = x + s (.) gelu(z) (s per channel, or per image and channel
      with drop path), in one pass instead of PyTorch's five:

          dL/dz = g s gelu'(z),    dL/ds = sum over positions of g gelu(z)     (per chunk of positions; the caller sums)

      with erf as PyTorch's vectorised CPU kernels compute it (Abramowitz and Stegun 7.1.26, |error| <= 1.5e-7).
*/
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define CB 16 /* channels a vector: one 512-bit register */
#else
#define CB 8 /* two 128-bit or one 256-bit register, so that 7 sums and 7 window vectors stay in registers */
#endif
#define K 7
#define MAX_THREADS 256
#define CHUNK 256 /* positions an item of the GELU residual's backward */

typedef float vec __attribute__((vector_size(CB * 4), aligned(4))); /* aligned(4): unaligned loads are fine */
typedef int32_t ivec __attribute__((vector_size(CB * 4), aligned(4)));

static inline vec load(const float *p) { return *(const vec *)p; }
static inline void store(float *p, vec v) { *(vec *)p = v; }
static inline vec splat(float f) { return (vec){0} + f; }

/* Threads. PyTorch's own OpenMP team where the caller hands over its runtime (use_openmp): a second pool of threads
   would contend for the cores with PyTorch's, which spin for a while after each of its parallel regions. Otherwise
   POSIX threads, the calling thread taking a share, and the share of a thread that cannot be started. Either way
   items 0 .. items - 1 are shared round-robin. */
typedef void (*item_fn)(const void *args, int64_t item);
typedef struct { item_fn fn; const void *args; int64_t items, threads, index; } share_t;
typedef void (*gomp_parallel_fn)(void (*body)(void *), void *data, unsigned threads, unsigned flags);
typedef int (*omp_int_fn)(void);

static gomp_parallel_fn gomp_parallel = 0; /* GOMP_parallel, the entry every OpenMP runtime on Linux exports */
static omp_int_fn omp_thread_num = 0, omp_num_threads = 0;

int use_openmp(void *parallel, void *thread_num, void *num_threads) {
    gomp_parallel = (gomp_parallel_fn)parallel;
    omp_thread_num = (omp_int_fn)thread_num;
    omp_num_threads = (omp_int_fn)num_threads;
    return 0;
}

static void *run_share(void *arg) {
    const share_t *share = arg;
    for (int64_t item = share->index; item < share->items; item += share->threads) share->fn(share->args, item);
    return 0;
}

static void run_openmp_share(void *arg) {
    share_t share = *(const share_t *)arg;
    share.index = omp_thread_num();
    share.threads = omp_num_threads();
    run_share(&share);
}

static void parallel_for(item_fn fn, const void *args, int64_t items, int64_t threads) {
    threads = threads < items ? threads : items;
    threads = threads < MAX_THREADS ? threads : MAX_THREADS;
    if (threads < 1) return;
    if (gomp_parallel && threads > 1) {
        share_t share = {fn, args, items, threads, 0};
        gomp_parallel(run_openmp_share, &share, (unsigned)threads, 0);
        return;
    }
    pthread_t handles[MAX_THREADS];
    share_t shares[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < threads; t++) shares[t] = (share_t){fn, args, items, threads, t};
    for (int64_t t = 1; t < threads; t++) started[t] = pthread_create(&handles[t], 0, run_share, &shares[t]) == 0;
    run_share(&shares[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(handles[t], 0);
        else run_share(&shares[t]);
    }
}

/* 1. The 7x7 depthwise weight gradient. */

typedef struct {
    const float *x, *g;
    float *out;
    int64_t height, width, channels;
} depthwise_t;

/* Adds row h's terms for kernel row i to sums[0..6]: sums[j] += sum_w g[h, w] x[h + i - 3, w + j - 3]. */
static inline void row_terms(const float *g_row, const float *x_row, int64_t width, int64_t stride, vec sums[K]) {
    const vec zero = {0};
    vec s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3], s4 = sums[4], s5 = sums[5], s6 = sums[6];
    /* The window x[w - 3 .. w + 3]; columns outside the row are zero. */
    vec x0 = zero, x1 = zero, x2 = zero, x3 = load(x_row), x4 = width > 1 ? load(x_row + stride) : zero;
    vec x5 = width > 2 ? load(x_row + 2 * stride) : zero;
    for (int64_t w = 0; w < width; w++) {
        const vec x6 = w + 3 < width ? load(x_row + (w + 3) * stride) : zero;
        const vec gw = load(g_row + w * stride);
        s0 += gw * x0; s1 += gw * x1; s2 += gw * x2; s3 += gw * x3; s4 += gw * x4; s5 += gw * x5; s6 += gw * x6;
        x0 = x1; x1 = x2; x2 = x3; x3 = x4; x4 = x5; x5 = x6;
    }
    sums[0] = s0; sums[1] = s1; sums[2] = s2; sums[3] = s3; sums[4] = s4; sums[5] = s5; sums[6] = s6;
}

/* out[b][c][i][j] for the item's image b and channels c0 .. c0 + CB - 1. Rows outer, kernel rows inner: a g row
   is read from memory once and used seven times from cache. */
static void depthwise_item(const void *args, int64_t item) {
    const depthwise_t *a = args;
    const int64_t blocks = a->channels / CB, b = item / blocks, c0 = item % blocks * CB;
    const int64_t row = a->width * a->channels;
    const float *x = a->x + b * a->height * row, *g = a->g + b * a->height * row;
    vec sums[K][K] = {{{0}}};
    for (int64_t h = 0; h < a->height; h++)
        for (int64_t i = 0; i < K; i++) {
            const int64_t h_in = h + i - K / 2;
            if (h_in >= 0 && h_in < a->height)
                row_terms(g + h * row + c0, x + h_in * row + c0, a->width, a->channels, sums[i]);
        }
    float *out = a->out + (b * a->channels + c0) * K * K;
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++)
            for (int64_t c = 0; c < CB; c++) out[c * K * K + i * K + j] = sums[i][j][c];
}

/* 2. The GELU residual's backward. */

/* exp(x) for x <= 0 (all GELU needs): 2^n e^r with |r| <= ln2 / 2 and a degree-6 Taylor polynomial for e^r. */
static inline vec exp_negative(vec x) {
    const ivec normal = x > -87.0f; /* below, e^x leaves float's normal range: 0, as PyTorch's exp gives */
    x = (vec)(((ivec)x & normal) | ((ivec)splat(-87.0f) & ~normal));
    const ivec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec); /* x <= 0: to nearest */
    const vec nf = __builtin_convertvector(n, vec);
    const vec r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187045e-06f; /* ln2 in two parts */
    vec p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f; p = p * r + 1.0f / 24.0f; p = p * r + 1.0f / 6.0f; p = p * r + 0.5f;
    p = p * r + 1.0f; p = p * r + 1.0f;
    return (vec)((ivec)(p * (vec)((n + 127) << 23)) & normal); /* times 2^n (exponent bits); 0 below -87 */
}

static inline vec erf_as(vec x) {
    const ivec sign = (ivec)x & (int32_t)0x80000000;
    const vec a = (vec)((ivec)x ^ sign), t = 1.0f / (1.0f + 0.3275911f * a);
    const vec r = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f
                       + t * 1.061405429f))));
    return (vec)((ivec)(1.0f - r * exp_negative(-a * a)) | sign);
}

typedef struct {
    const float *grad, *z, *scale;
    float *grad_z, *grad_scale;
    int64_t positions, channels, scale_per_image, chunks;
} residual_t;

static void residual_item(const void *args, int64_t item) {
    const residual_t *a = args;
    const int64_t channels = a->channels, b = item / a->chunks, p0 = item % a->chunks * CHUNK;
    const int64_t p1 = p0 + CHUNK < a->positions ? p0 + CHUNK : a->positions;
    const float *s = a->scale + b * a->scale_per_image * channels;
    float *grad_scale = a->grad_scale + item * channels;
    for (int64_t c = 0; c < channels; c++) grad_scale[c] = 0.0f;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t o = (b * a->positions + p) * channels;
        for (int64_t c = 0; c < channels; c += CB) {
            const vec z = load(a->z + o + c), g = load(a->grad + o + c);
            const vec cdf = 0.5f * (1.0f + erf_as(z * (float)M_SQRT1_2)); /* gelu(z) = z cdf */
            const vec pdf = 0.3989422804014327f * exp_negative(-0.5f * z * z);
            store(a->grad_z + o + c, g * load(s + c) * (cdf + z * pdf));
            store(grad_scale + c, load(grad_scale + c) + g * z * cdf);
        }
    }
}

/* The entry points: 0 on success, 1 on arguments they do not take (nothing is written then). */

/* Channels a vector: both kernels take channel counts that are multiples of it. */
int channel_block(void) { return CB; }

/* x, g: (batch, height, width, channels) contiguous; out: (batch, channels, 7, 7). */
int depthwise7_weight_grad(const float *x, const float *g, float *out, int64_t batch, int64_t height, int64_t width,
                           int64_t channels, int64_t threads) {
    if (batch < 1 || height < 1 || width < 1 || channels < CB || channels % CB || threads < 1) return 1;
    const depthwise_t args = {x, g, out, height, width, channels};
    parallel_for(depthwise_item, &args, batch * (channels / CB), threads);
    return 0;
}

/* Positions an item of gelu_residual_backward: its grad_scale has ceil(positions / it) rows per image. */
int gelu_residual_chunk(void) { return CHUNK; }

/* grad, z, grad_z: (batch, positions, channels) contiguous; scale: (channels) or (batch, channels) as
   scale_per_image is 0 or 1; grad_scale: (batch, ceil(positions / CHUNK), channels) partial sums. */
int gelu_residual_backward(const float *grad, const float *z, const float *scale, float *grad_z, float *grad_scale,
                           int64_t batch, int64_t positions, int64_t channels, int64_t scale_per_image,
                           int64_t threads) {
    if (batch < 1 || positions < 1 || channels < CB || channels % CB || threads < 1 || scale_per_image < 0
        || scale_per_image > 1) return 1;
    const int64_t chunks = (positions + CHUNK - 1) / CHUNK;
    const residual_t args = {grad, z, scale, grad_z, grad_scale, positions, channels, scale_per_image, chunks};
    parallel_for(residual_item, &args, batch * chunks, threads);
    return 0;
}
