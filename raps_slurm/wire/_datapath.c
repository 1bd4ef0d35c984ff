/* raps_slurm.wire._datapath: a logged message's send and its copy into the log, as one
 * pass with the GIL released.
 *
 * A logged message is copied into the sender's log and written to its socket. Done one
 * after the other, the receiver waits idle while the sender copies. Here the frame is
 * written straight from the application's buffer with non-blocking sendmsg calls, and
 * the copy into the log goes on piece by piece in between: while the peer reads what
 * was just sent, and whenever the socket is full. Python keeps the framing (the header
 * and its length prefix come in `head`) and the waiting (`on_full`): this module returns
 * when the socket is full and everything is copied, when the frame is sent and copied,
 * or with the errno of a failed send once the copy is complete.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_PARTS 8 /* the MPI layer sends an envelope and one buffer */
#define MAX_IOV (MAX_PARTS + 1)

typedef struct {
    Py_buffer head;
    Py_buffer parts[MAX_PARTS];
    int nparts;
    Py_buffer dst;
} bufs;

static void release(bufs *b) {
    if (b->head.obj)
        PyBuffer_Release(&b->head);
    for (int i = 0; i < b->nparts; i++)
        PyBuffer_Release(&b->parts[i]);
    if (b->dst.obj)
        PyBuffer_Release(&b->dst);
}

/* A message at least this large is copied past the cache (x86-64 with AVX2): the log's
 * room is memory no core touched lately, and a plain copy read each destination line in
 * before writing it. 8 MiB into a cold arena took 0.31 ms against 0.48 on the test
 * machine, and the cache keeps what the peer and the kernel are copying meanwhile.
 * Decided by the message's size, not a piece's (its first is short by its envelope). */
#define STREAM_AT (256 << 10)

static int streaming; /* the CPU has AVX2: set once, when the module loads */

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void copy_streaming(char *dst, const char *src,
                                                            size_t n) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31; /* stores 32-byte aligned */
    if (n < head + 128) { /* a short part of a large message (its envelope) */
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    _mm_sfence(); /* ordered before anything that says the copy is done */
    memcpy(dst + i, src + i, n - i);
}
#endif

/* The CRC-32C (Castagnoli, reflected) of a message, taken in the copy's own pass where
 * the CPU has AVX-512 and VPCLMULQDQ (`folding`): each 64 bytes the copy loads are also
 * folded into four running 512-bit remainders (carry-less multiplications, a few cycles
 * per 64 bytes, hidden under the copy's memory traffic), and the 64 bytes left at the end
 * are summed with the CRC-32C instruction. The convention is the crc32c package's:
 * crc32c(b, crc32c(a)) == crc32c(a + b). Summed apart, the same bytes were read twice and
 * the instruction's one result per cycle cost as much as the copy. Without them, the
 * caller sums in Python (datapath.py). */
static int folding;

#if defined(__x86_64__)
/* Fold constants, (x^(D+32) mod P, x^(D-32) mod P) bit-reflected and shifted left by one,
 * for D = 2048 (a 128-bit lane moved 256 bytes on) and D = 512 (64 bytes on). */
#define K2048_LO 0xdcb17aa4ULL
#define K2048_HI 0xb9e02b86ULL
#define K512_LO 0x740eef02ULL
#define K512_HI 0x9e4addf8ULL

__attribute__((target("sse4.2"))) static uint32_t crc_raw(uint32_t reg, const char *p,
                                                           size_t n) {
    uint64_t c = reg, w;
    for (; n >= 8; n -= 8, p += 8) {
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    for (; n; n--, p++)
        c = _mm_crc32_u8((uint32_t)c, (unsigned char)*p);
    return (uint32_t)c;
}

__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i fold(__m512i x, __m512i k,
                                                                       __m512i data) {
    __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00), hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, data, 0x96); /* lo ^ hi ^ data */
}

/* Copy n bytes to dst (stored past the cache when `stream`; nothing stored when dst is
 * NULL) and return their CRC-32C, continuing crc. */
__attribute__((target("avx512f,vpclmulqdq,sse4.2"))) static uint32_t
copy_fold(char *dst, const char *src, size_t n, uint32_t crc, int stream) {
    uint32_t reg = ~crc;
    size_t head = dst && stream ? (64 - ((uintptr_t)dst & 63)) & 63 : 0;
    if (n < head + 512) { /* too short to fold: copy, then the instruction */
        if (dst)
            memcpy(dst, src, n);
        return ~crc_raw(reg, src, n);
    }
    if (dst) {
        memcpy(dst, src, head);
        dst += head;
    }
    reg = crc_raw(reg, src, head);
    src += head, n -= head;
    __m512i x[4];
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_loadu_si512((const void *)(src + 64 * i));
    for (int i = 0; dst && i < 4; i++) {
        if (stream)
            _mm512_stream_si512((void *)(dst + 64 * i), x[i]);
        else
            _mm512_storeu_si512((void *)(dst + 64 * i), x[i]);
    }
    /* the register so far goes into the first four bytes, as the CRC itself would */
    x[0] = _mm512_xor_si512(x[0], _mm512_castsi128_si512(_mm_cvtsi32_si128((int)reg)));
    const __m512i k256 = _mm512_set4_epi64((long long)K2048_HI, (long long)K2048_LO,
                                           (long long)K2048_HI, (long long)K2048_LO);
    const __m512i k64 = _mm512_set4_epi64((long long)K512_HI, (long long)K512_LO,
                                          (long long)K512_HI, (long long)K512_LO);
    size_t i = 256;
    for (; i + 256 <= n; i += 256) {
        for (int j = 0; j < 4; j++) {
            __m512i d = _mm512_loadu_si512((const void *)(src + i + 64 * j));
            if (!dst)
                ;
            else if (stream)
                _mm512_stream_si512((void *)(dst + i + 64 * j), d);
            else
                _mm512_storeu_si512((void *)(dst + i + 64 * j), d);
            x[j] = fold(x[j], k256, d);
        }
    }
    if (dst && stream)
        _mm_sfence(); /* ordered before anything that says the copy is done */
    x[1] = fold(x[0], k64, x[1]);
    x[2] = fold(x[1], k64, x[2]);
    x[3] = fold(x[2], k64, x[3]);
    char rest[64];
    _mm512_storeu_si512((void *)rest, x[3]);
    reg = crc_raw(0, rest, 64); /* the 64 bytes stand for everything folded */
    if (dst)
        memcpy(dst + i, src + i, n - i);
    return ~crc_raw(reg, src + i, n - i);
}
#endif

/* Copy bytes [from, to) of the parts joined into dst at the same offsets; with `crc` not
 * NULL (folding only), their CRC-32C continues it. `stream`: a large message's copy. */
static void copy_range(const bufs *b, Py_ssize_t from, Py_ssize_t to, uint32_t *crc,
                       int stream) {
    Py_ssize_t base = 0;
    for (int i = 0; i < b->nparts && from < to; i++) {
        Py_ssize_t len = b->parts[i].len, end = base + len;
        if (from < end) {
            Py_ssize_t n = (to < end ? to : end) - from;
            char *d = (char *)b->dst.buf + from;
            const char *s = (const char *)b->parts[i].buf + (from - base);
#if defined(__x86_64__)
            if (crc) {
                *crc = copy_fold(d, s, (size_t)n, *crc, stream && streaming);
            } else
#endif
#if defined(__x86_64__)
            if (stream && streaming)
                copy_streaming(d, s, (size_t)n);
            else
#endif
                memcpy(d, s, (size_t)n);
            from += n;
        }
        base = end;
    }
}

/* The iovec of what is left to send after `sent` bytes of head + parts. */
static int left_iov(const bufs *b, Py_ssize_t sent, struct iovec *iov) {
    int n = 0;
    Py_ssize_t base = 0;
    const Py_buffer *all[MAX_IOV];
    all[0] = &b->head;
    for (int i = 0; i < b->nparts; i++)
        all[i + 1] = &b->parts[i];
    for (int i = 0; i < b->nparts + 1; i++) {
        Py_ssize_t len = all[i]->len, end = base + len;
        if (sent < end && len) {
            Py_ssize_t skip = sent > base ? sent - base : 0;
            iov[n].iov_base = (char *)all[i]->buf + skip;
            iov[n].iov_len = (size_t)(len - skip);
            n++;
        }
        base = end;
    }
    return n;
}

/* Hold the buffers of `parts` (C-contiguous, at most MAX_PARTS); their total size in
 * *len. -1 with an exception set. */
static int get_parts(bufs *b, PyObject *parts, Py_ssize_t *len) {
    PyObject *seq = PySequence_Fast(parts, "parts must be a sequence of buffers");
    if (seq == NULL)
        return -1;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(seq);
    *len = 0;
    if (np > MAX_PARTS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%zd parts: at most %d", np, MAX_PARTS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < np; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &b->parts[i],
                               PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        b->nparts++;
        *len += b->parts[i].len;
    }
    Py_DECREF(seq);
    return 0;
}

PyDoc_STRVAR(send_copy_doc,
"send_copy(fd, head, parts, dst, sent, copied, piece, crc, fold, /)\n"
"    -> (sent, copied, errno, crc)\n\n"
"Write head + parts joined to the non-blocking-capable socket fd from byte `sent` on,\n"
"and copy parts joined into the writable buffer dst (their total size) from byte\n"
"`copied` on, `piece` bytes between two sends. Returns the new offsets and 0 (all sent\n"
"and copied), EAGAIN (the socket is full, all copied) or the errno of a failed send\n"
"(all copied). With `fold` (where FOLDING is 1), the copy takes the CRC-32C of what it\n"
"copies: `crc` is that of the first `copied` bytes, and the one returned that of all\n"
"copied; else the CRC returned is None. The GIL is released throughout.");

static PyObject *send_copy(PyObject *self, PyObject *args) {
    int fd, fold;
    PyObject *head, *parts;
    Py_buffer dst;
    Py_ssize_t sent, copied, piece;
    unsigned int crc;
    bufs b;
    memset(&b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "iOOw*nnnIp:send_copy", &fd, &head, &parts, &dst, &sent,
                          &copied, &piece, &crc, &fold))
        return NULL;
    b.dst = dst;
    if (PyObject_GetBuffer(head, &b.head, PyBUF_SIMPLE) < 0)
        goto fail;
    Py_ssize_t srclen;
    if (get_parts(&b, parts, &srclen) < 0)
        goto fail;
    Py_ssize_t total = b.head.len + srclen;
    if (b.dst.len != srclen || sent < 0 || sent > total || copied < 0 || copied > srclen ||
        piece <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "dst of %zd bytes for parts of %zd, sent %zd of %zd, copied %zd, "
                     "piece %zd", b.dst.len, srclen, sent, total, copied, piece);
        goto fail;
    }
    if (fold && !folding) {
        PyErr_SetString(PyExc_ValueError, "fold: this CPU cannot (FOLDING is 0)");
        goto fail;
    }
    int err = 0, stream = srclen >= STREAM_AT;
    uint32_t c = crc, *cp = fold ? &c : NULL;
    Py_BEGIN_ALLOW_THREADS
    while (sent < total || copied < srclen) {
        if (sent == total) { /* all on its way: the rest of the copy */
            copy_range(&b, copied, srclen, cp, stream);
            copied = srclen;
            break;
        }
        struct iovec iov[MAX_IOV];
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)left_iov(&b, sent, iov);
        ssize_t n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            err = errno;
            copy_range(&b, copied, srclen, cp, stream); /* the log keeps it whole anyway */
            copied = srclen;
            break;
        }
        if (n > 0)
            sent += n;
        if (copied < srclen) { /* the peer reads what was sent meanwhile */
            Py_ssize_t to = copied + piece < srclen ? copied + piece : srclen;
            copy_range(&b, copied, to, cp, stream);
            copied = to;
        } else if (n < 0) {
            err = EAGAIN; /* full, and nothing left to do here */
            break;
        }
    }
    Py_END_ALLOW_THREADS
    release(&b);
    if (fold)
        return Py_BuildValue("nniI", sent, copied, err, (unsigned int)c);
    return Py_BuildValue("nniO", sent, copied, err, Py_None);
fail:
    release(&b);
    return NULL;
}

PyDoc_STRVAR(copy_doc,
"copy(dst, parts, fold, /) -> int | None\n\n"
"Copy parts joined into the writable buffer dst (exactly their size), the GIL released;\n"
"with `fold` (where FOLDING is 1), returns their CRC-32C, taken in the same pass, else\n"
"None.");

static PyObject *copy(PyObject *self, PyObject *args) {
    PyObject *parts;
    Py_buffer dst;
    int fold;
    bufs b;
    memset(&b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "w*Op:copy", &dst, &parts, &fold))
        return NULL;
    b.dst = dst;
    Py_ssize_t srclen;
    if (get_parts(&b, parts, &srclen) < 0)
        goto fail;
    if (b.dst.len != srclen) {
        PyErr_Format(PyExc_ValueError, "dst of %zd bytes for parts of %zd", b.dst.len, srclen);
        goto fail;
    }
    if (fold && !folding) {
        PyErr_SetString(PyExc_ValueError, "fold: this CPU cannot (FOLDING is 0)");
        goto fail;
    }
    uint32_t c = 0;
    Py_BEGIN_ALLOW_THREADS
    copy_range(&b, 0, srclen, fold ? &c : NULL, srclen >= STREAM_AT);
    Py_END_ALLOW_THREADS
    release(&b);
    if (fold)
        return PyLong_FromUnsignedLong(c);
    Py_RETURN_NONE;
fail:
    release(&b);
    return NULL;
}

PyDoc_STRVAR(sum_doc,
"sum(buf, crc, /) -> int\n\n"
"The CRC-32C of buf, continuing crc, folded as copy() folds (FOLDING must be 1), the GIL\n"
"released.");

static PyObject *sum(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned int crc;
    if (!PyArg_ParseTuple(args, "y*I:sum", &b, &crc))
        return NULL;
    if (!folding) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "sum: this CPU cannot fold (FOLDING is 0)");
        return NULL;
    }
    uint32_t c = crc;
#if defined(__x86_64__)
    Py_BEGIN_ALLOW_THREADS
    c = copy_fold(NULL, (const char *)b.buf, (size_t)b.len, c, 0);
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

PyDoc_STRVAR(address_doc,
"address(buf, /) -> int\n\n"
"Where the bytes of buf (any buffer, read-only too) start in memory.");

static PyObject *address(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyLong_FromVoidPtr(b.buf);
    PyBuffer_Release(&b);
    return out;
}

PyDoc_STRVAR(untrack_doc,
"untrack(obj, /) -> None\n\n"
"Take obj out of the cyclic garbage collector's sight, as CPython does with tuples\n"
"and dicts that hold no container: a full collection no longer visits it. Only for\n"
"an object in no reference cycle (a log entry: numbers, bytes, its arena room).");

static PyObject *untrack(PyObject *self, PyObject *arg) {
    if (PyObject_IS_GC(arg))
        PyObject_GC_UnTrack(arg); /* a no-op when it is not tracked */
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"send_copy", send_copy, METH_VARARGS, send_copy_doc},
    {"copy", copy, METH_VARARGS, copy_doc},
    {"sum", sum, METH_VARARGS, sum_doc},
    {"address", address, METH_O, address_doc},
    {"untrack", untrack, METH_O, untrack_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "raps_slurm.wire._datapath",
    "A logged message's send and its copy into the log, the GIL released.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__datapath(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    streaming = __builtin_cpu_supports("avx2") != 0;
    folding = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
              __builtin_cpu_supports("sse4.2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MAX_PARTS", MAX_PARTS) < 0 ||
        PyModule_AddIntConstant(m, "STREAMING", streaming) < 0 ||
        PyModule_AddIntConstant(m, "FOLDING", folding) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
