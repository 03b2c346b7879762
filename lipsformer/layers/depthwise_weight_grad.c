/* The weight gradient of a stride-1, 'same'-padded 7x7 depthwise convolution of NHWC float32 maps:

       dW[b][c][i][j] = sum_{h, w} g[b, h, w, c] x[b, h + i - 3, w + j - 3, c]      (x zero outside the map)

   per image b (the caller sums over the batch). oneDNN has no fast kernel for it on CPU (see depthwise_conv.py).
   Here a thread takes (image, block of CB channels) items; for each output row h and kernel row i it slides a
   window of seven x vectors along the row, so each step loads one x vector and one g vector for seven
   multiply-adds, all in registers. Compiled and loaded by lipsformer.utils.native.
*/
#include <pthread.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define CB 16 /* channels a vector: one 512-bit register */
#else
#define CB 8 /* two 128-bit or one 256-bit register, so that 7 sums and 7 window vectors stay in registers */
#endif
#define K 7
#define MAX_THREADS 256

typedef float vec __attribute__((vector_size(CB * 4), aligned(4))); /* aligned(4): unaligned loads are fine */

typedef struct {
    const float *x, *g;
    float *out;
    int64_t batch, height, width, channels, threads, index;
} job_t;

static inline vec load(const float *p) { return *(const vec *)p; }

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

/* out[c][i][j] for one image and channels c0 .. c0 + CB - 1. Rows outer, kernel rows inner: a g row is read
   from memory once and used seven times from cache. */
static void image_block(const float *x, const float *g, float *out, int64_t height, int64_t width,
                        int64_t channels, int64_t c0) {
    vec sums[K][K] = {{{0}}};
    const int64_t row = width * channels;
    for (int64_t h = 0; h < height; h++)
        for (int64_t i = 0; i < K; i++) {
            const int64_t h_in = h + i - K / 2;
            if (h_in >= 0 && h_in < height)
                row_terms(g + h * row + c0, x + h_in * row + c0, width, channels, sums[i]);
        }
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++)
            for (int64_t c = 0; c < CB; c++) out[(c0 + c) * K * K + i * K + j] = sums[i][j][c];
}

static void *work(void *arg) {
    const job_t *job = arg;
    const int64_t blocks = job->channels / CB, image = job->height * job->width * job->channels;
    for (int64_t item = job->index; item < job->batch * blocks; item += job->threads) {
        const int64_t b = item / blocks;
        image_block(job->x + b * image, job->g + b * image, job->out + b * job->channels * K * K, job->height,
                    job->width, job->channels, item % blocks * CB);
    }
    return 0;
}

/* Channels a vector: the channel count must be a multiple of it. */
int depthwise7_channel_block(void) { return CB; }

/* x, g: (batch, height, width, channels) contiguous; out: (batch, channels, 7, 7). 0 on success, 1 on bad
   arguments. A thread that cannot be started has its share done by the calling thread. */
int depthwise7_weight_grad(const float *x, const float *g, float *out, int64_t batch, int64_t height, int64_t width,
                           int64_t channels, int64_t threads) {
    if (batch < 1 || height < 1 || width < 1 || channels < CB || channels % CB || threads < 1) return 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_t handles[MAX_THREADS];
    job_t jobs[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < threads; t++) jobs[t] = (job_t){x, g, out, batch, height, width, channels, threads, t};
    for (int64_t t = 1; t < threads; t++) started[t] = pthread_create(&handles[t], 0, work, &jobs[t]) == 0;
    work(&jobs[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(handles[t], 0);
        else work(&jobs[t]);
    }
    return 0;
}
