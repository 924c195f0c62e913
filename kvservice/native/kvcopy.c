/* Page copies between an engine's KV and pages, for the connector's page formats (pagecopy.py's pieces).
 *
 * A piece is a strided view over the engine's storage: block b's element at index i sits at
 *   base + src_offset + b * block_stride + sum(i_k * src_stride_k)        in the engine, and at
 *   page + dst_offset + sum(i_k * dst_stride_k)                           in its page (all in bytes),
 * the last dim unit-stride on both sides (a run of bytes). A job is (block, page row) pairs times pieces;
 * it is cut into items (pair, piece, index of the piece's first dim) that threads take in equal shares.
 *
 * The one case a strided byte copy cannot do at memory speed is a transpose (vLLM's CPU attention keeps K
 * channel-major within a block, pages keep it token-major): a piece whose last dim is one element of 1, 2,
 * 4 or 8 bytes. Its two dims before that are walked as a 2-D transpose, the writes contiguous (the inner
 * loop over the dim whose destination stride is the element), the reads strided within a block that fits
 * in L1.
 *
 * Built by `make native` (cc -O3 -shared -fPIC -pthread); loaded with ctypes (kvservice/native/__init__.py).
 * No Python API: the same library serves any interpreter of the machine's architecture.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define KV_MAX_DIMS 8
#define KV_HEADER 5 /* base, src_offset, block_stride, dst_offset, ndims */
#define KV_RECORD (KV_HEADER + 3 * KV_MAX_DIMS)
#define KV_MAX_THREADS 64

typedef struct {
    const int64_t *pieces; /* npieces records of KV_RECORD int64 */
    int npieces;
    uint8_t *pages;
    int64_t page_stride;
    const int64_t *blocks, *rows;
    int64_t npairs;
    int scatter; /* 0: engine -> pages (save); 1: pages -> engine (load) */
    int64_t first, last; /* this thread's items */
} kv_job;

/* A copy whose destination is written with non-temporal stores where it is whole 16-byte words: the pages and
 * the engine's KV are far larger than the caches, so a plain store's read of each destination line first
 * (write-allocate) is a third of the memory traffic. Each thread fences once when it is done. */
static inline void put(uint8_t *to, const uint8_t *from, int64_t n) {
#if defined(__SSE2__)
    if (n >= 64 && ((uintptr_t)to & 15) == 0 && (n & 15) == 0) {
        for (int64_t i = 0; i < n; i += 16)
            _mm_stream_si128((__m128i *)(to + i), _mm_loadu_si128((const __m128i *)(from + i)));
        return;
    }
#endif
    memcpy(to, from, (size_t)n);
}

/* dims: (size, from_stride, to_stride) per dim, last one a unit-stride run of dims[3*(nd-1)] bytes. */
#define TRANSPOSE(T)                                                                              \
    do {                                                                                          \
        if (tsb == (int64_t)sizeof(T) && nb * (int64_t)sizeof(T) <= (int64_t)sizeof(row)) {      \
            for (int64_t a = 0; a < na; a++) {                                                    \
                const uint8_t *fa = from + a * fsa;                                               \
                T *r = (T *)row;                                                                  \
                for (int64_t b = 0; b < nb; b++)                                                  \
                    memcpy(r + b, fa + b * fsb, sizeof(T));                                       \
                put(to + a * tsa, row, nb * (int64_t)sizeof(T));                                  \
            }                                                                                     \
            break;                                                                                \
        }                                                                                         \
        for (int64_t a = 0; a < na; a++) {                                                        \
            const uint8_t *fa = from + a * fsa;                                                   \
            uint8_t *ta = to + a * tsa;                                                           \
            for (int64_t b = 0; b < nb; b++)                                                      \
                memcpy(ta + b * tsb, fa + b * fsb, sizeof(T));                                    \
        }                                                                                         \
    } while (0)

#if defined(__SSE2__)
/* 8x8 of 16-bit: rows r[0..7] (8 elements each) -> columns. */
static inline void t8x8_16(__m128i r[8]) {
    __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
    __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
    __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    r[0] = _mm_unpacklo_epi64(b0, b4), r[1] = _mm_unpackhi_epi64(b0, b4);
    r[2] = _mm_unpacklo_epi64(b1, b5), r[3] = _mm_unpackhi_epi64(b1, b5);
    r[4] = _mm_unpacklo_epi64(b2, b6), r[5] = _mm_unpackhi_epi64(b2, b6);
    r[6] = _mm_unpacklo_epi64(b3, b7), r[7] = _mm_unpackhi_epi64(b3, b7);
}

/* 4x4 of 32-bit. */
static inline void t4x4_32(__m128i r[4]) {
    __m128i a0 = _mm_unpacklo_epi32(r[0], r[1]), a1 = _mm_unpackhi_epi32(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi32(r[2], r[3]), a3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(a0, a2), r[1] = _mm_unpackhi_epi64(a0, a2);
    r[2] = _mm_unpacklo_epi64(a1, a3), r[3] = _mm_unpackhi_epi64(a1, a3);
}
#endif

/* A 2-D transpose whose reads run along a and writes along b (element `es` bytes, the from side's a-stride and
 * the to side's b-stride both `es`) into `tile`, dense: row a holds nb elements. Returns 0 when the shape does
 * not suit the vector kernels. */
static int transpose_tile(const uint8_t *from, int64_t na, int64_t nb, int64_t fsb, int64_t es, uint8_t *tile) {
#if defined(__SSE2__)
    const int64_t k = es == 2 ? 8 : es == 4 ? 4 : 0; /* elements per 16-byte vector */
    if (k == 0 || na % k || nb % k)
        return 0;
    __m128i r[8];
    for (int64_t a0 = 0; a0 < na; a0 += k)
        for (int64_t b0 = 0; b0 < nb; b0 += k) {
            for (int64_t j = 0; j < k; j++) /* from: k b's, each k consecutive a's */
                r[j] = _mm_loadu_si128((const __m128i *)(from + (b0 + j) * fsb + a0 * es));
            if (k == 8)
                t8x8_16(r);
            else
                t4x4_32(r);
            for (int64_t i = 0; i < k; i++) /* row a0 + i: k consecutive b's */
                _mm_store_si128((__m128i *)(tile + ((a0 + i) * nb + b0) * es), r[i]);
        }
    return 1;
#else
    (void)from, (void)na, (void)nb, (void)fsb, (void)es, (void)tile;
    return 0;
#endif
}

static void copy_dims(const uint8_t *from, uint8_t *to, const int64_t *dims, int nd) {
    if (nd == 1) {
        put(to, from, dims[0]);
        return;
    }
    const int64_t run = dims[3 * (nd - 1)];
    if (nd > 3 || (nd == 3 && !(run == 1 || run == 2 || run == 4 || run == 8))) {
        for (int64_t i = 0; i < dims[0]; i++)
            copy_dims(from + i * dims[1], to + i * dims[2], dims + 3, nd - 1);
        return;
    }
    if (nd == 3) {
        /* a transpose: the inner loop over the dim whose writes are contiguous */
        const int64_t *x = dims, *y = dims + 3;
        if (x[2] == run && y[2] != run) {
            x = dims + 3;
            y = dims;
        }
        const int64_t na = x[0], fsa = x[1], tsa = x[2], nb = y[0], fsb = y[1], tsb = y[2];
        /* per thread, not per frame: copy_dims recurses once per dim */
        static _Thread_local _Alignas(64) uint8_t row[16384];
#if defined(__SSE2__)
        /* vector tiles, in strips of rows that fit the buffer (a block's K may be larger than it) */
        const int64_t k = run == 2 ? 8 : run == 4 ? 4 : 0;
        const int64_t strip = k ? (int64_t)sizeof(row) / (nb * run) / k * k : 0;
        if (fsa == run && tsb == run && k && strip >= k && na % k == 0 && nb % k == 0) {
            for (int64_t a0 = 0; a0 < na; a0 += strip) {
                const int64_t m = na - a0 < strip ? na - a0 : strip;
                transpose_tile(from + a0 * run, m, nb, fsb, run, row);
                if (tsa == nb * run)
                    put(to + a0 * tsa, row, m * nb * run);
                else
                    for (int64_t a = 0; a < m; a++)
                        put(to + (a0 + a) * tsa, row + a * nb * run, nb * run);
            }
            return;
        }
#endif
        switch (run) {
        case 1: TRANSPOSE(uint8_t); break;
        case 2: TRANSPOSE(uint16_t); break;
        case 4: TRANSPOSE(uint32_t); break;
        default: TRANSPOSE(uint64_t); break;
        }
        return;
    }
    if (nd == 2) {
        const int64_t n = dims[0], fs = dims[1], ts = dims[2];
        for (int64_t i = 0; i < n; i++)
            put(to + i * ts, from + i * fs, run);
    }
}

/* A piece's items per pair: its first dim, or one for a piece that is a single run of bytes. */
static int64_t first_dim(const int64_t *r) { return r[4] == 1 ? 1 : r[KV_HEADER]; }

static int64_t piece_items(const kv_job *job, int p) {
    return job->npairs * first_dim(job->pieces + (int64_t)p * KV_RECORD);
}

/* Whether the pieces share their first dim (the CPU layout's K and V: the layers): items are then (pair, index)
 * and each takes every piece, so that one layer's K and V move together and the page is written in order. */
static int shared_first_dim(const int64_t *pieces, int npieces) {
    for (int p = 0; p < npieces; p++) {
        const int64_t *r = pieces + (int64_t)p * KV_RECORD;
        if (r[4] == 1 || r[KV_HEADER] != pieces[KV_HEADER])
            return 0;
    }
    return npieces > 1;
}

static void one_item(const kv_job *job, const int64_t *r, int64_t pair, int64_t i0) {
    uint8_t *base = (uint8_t *)(intptr_t)r[0];
    const int nd = (int)r[4];
    uint8_t *engine = base + r[1] + job->blocks[pair] * r[2];
    uint8_t *page = job->pages + job->rows[pair] * job->page_stride + r[3];
    if (nd == 1) { /* the piece is one run of bytes */
        if (job->scatter)
            put(engine, page, r[KV_HEADER]);
        else
            put(page, engine, r[KV_HEADER]);
        return;
    }
    engine += i0 * r[KV_HEADER + 1];
    page += i0 * r[KV_HEADER + 2];
    int64_t dims[3 * KV_MAX_DIMS]; /* the piece's dims after its first, oriented from -> to */
    for (int d = 1; d < nd; d++) {
        const int64_t *src = r + KV_HEADER + 3 * d;
        dims[3 * (d - 1)] = src[0];
        dims[3 * (d - 1) + 1] = job->scatter ? src[2] : src[1];
        dims[3 * (d - 1) + 2] = job->scatter ? src[1] : src[2];
    }
    if (job->scatter)
        copy_dims(page, engine, dims, nd - 1);
    else
        copy_dims(engine, page, dims, nd - 1);
}

static void *run_items(void *arg) {
    const kv_job *job = (const kv_job *)arg;
    if (shared_first_dim(job->pieces, job->npieces)) {
        const int64_t n0 = job->pieces[KV_HEADER];
        for (int64_t it = job->first; it < job->last; it++)
            for (int p = 0; p < job->npieces; p++)
                one_item(job, job->pieces + (int64_t)p * KV_RECORD, it / n0, it % n0);
    } else {
        int64_t start = 0;
        for (int p = 0; p < job->npieces; p++) {
            const int64_t *r = job->pieces + (int64_t)p * KV_RECORD;
            const int64_t n0 = first_dim(r), items = piece_items(job, p);
            const int64_t lo = job->first > start ? job->first : start;
            const int64_t hi = job->last < start + items ? job->last : start + items;
            for (int64_t it = lo - start; it < hi - start; it++)
                one_item(job, r, it / n0, it % n0);
            start += items;
        }
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return NULL;
}

/* Copies `npairs` (block, row) pairs of every piece; `nthreads` threads (1: the caller's alone), each set to run
 * on `cpus` (a CPU mask of `ncpus` bits; NULL: as the caller) so that a caller bound to one core still spreads.
 * Returns 0, or -1 when a thread could not be started (the caller's thread then did that share). */
int kv_copy(const int64_t *pieces, int npieces, uint8_t *pages, int64_t page_stride, const int64_t *blocks,
            const int64_t *rows, int64_t npairs, int scatter, int nthreads, const uint8_t *cpus, int ncpus) {
    if (nthreads < 1)
        nthreads = 1;
    if (nthreads > KV_MAX_THREADS)
        nthreads = KV_MAX_THREADS;
    int64_t total = 0;
    kv_job base = {pieces, npieces, pages, page_stride, blocks, rows, npairs, scatter, 0, 0};
    if (shared_first_dim(pieces, npieces))
        total = npairs * pieces[KV_HEADER];
    else
        for (int p = 0; p < npieces; p++)
            total += piece_items(&base, p);
    if (total < nthreads)
        nthreads = total > 0 ? (int)total : 1;
    kv_job jobs[KV_MAX_THREADS];
    pthread_t threads[KV_MAX_THREADS];
    int started[KV_MAX_THREADS] = {0};
    int rc = 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    cpu_set_t set;
    if (cpus != NULL && ncpus > 0) {
        CPU_ZERO(&set);
        for (int c = 0; c < ncpus && c < CPU_SETSIZE; c++)
            if (cpus[c / 8] & (1u << (c % 8)))
                CPU_SET(c, &set);
        if (pthread_attr_setaffinity_np(&attr, sizeof(set), &set) != 0) { /* as the caller, then */
            pthread_attr_destroy(&attr);
            pthread_attr_init(&attr);
        }
    }
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = base;
        jobs[t].first = total * t / nthreads;
        jobs[t].last = total * (t + 1) / nthreads;
        if (t > 0) {
            started[t] = pthread_create(&threads[t], &attr, run_items, &jobs[t]) == 0;
            if (!started[t])
                rc = -1;
        }
    }
    run_items(&jobs[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(threads[t], NULL);
        else
            run_items(&jobs[t]);
    }
    pthread_attr_destroy(&attr);
    return rc;
}

int kv_record_size(void) { return KV_RECORD; }
