/* raps_slurm.wire._udp: batched UDP receive with an HMAC-SHA256 check, batched sign-and-send.
 *
 * The coordinator's heartbeat path spent most of its CPU per datagram on two syscalls and
 * two HMACs run through Python objects. Here recvmmsg/sendmmsg move up to 64 datagrams per
 * syscall and the HMACs run on precomputed SHA-256 states, with the GIL released while the
 * socket is read. The message format stays in Python (raps_slurm/wire/heartbeat.py): this module
 * only knows "a datagram is a body followed by a 32-byte HMAC-SHA256 tag".
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_CTX: a state that can be copied by value */
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <string.h>
#include <sys/socket.h>

#define TAG 32
#define BLOCK 64
#define MAX_BATCH 64
#define SLOT 1024 /* bytes read per datagram: the callers reject anything above 512 */
#define MAX_KEYS 2

typedef struct {
    SHA256_CTX inner, outer; /* states after the ipad and opad blocks */
} hmac_key;

static int prepare_key(hmac_key *k, PyObject *obj) {
    char *data;
    Py_ssize_t len;
    unsigned char block[BLOCK], pad[BLOCK];
    if (PyBytes_AsStringAndSize(obj, &data, &len) < 0)
        return -1;
    if (len == 0) {
        PyErr_SetString(PyExc_ValueError, "empty HMAC key");
        return -1;
    }
    memset(block, 0, BLOCK);
    if (len > BLOCK)
        SHA256((const unsigned char *)data, (size_t)len, block); /* RFC 2104 */
    else
        memcpy(block, data, (size_t)len);
    for (int i = 0; i < BLOCK; i++)
        pad[i] = block[i] ^ 0x36;
    SHA256_Init(&k->inner);
    SHA256_Update(&k->inner, pad, BLOCK);
    for (int i = 0; i < BLOCK; i++)
        pad[i] = block[i] ^ 0x5c;
    SHA256_Init(&k->outer);
    SHA256_Update(&k->outer, pad, BLOCK);
    OPENSSL_cleanse(block, BLOCK);
    OPENSSL_cleanse(pad, BLOCK);
    return 0;
}

static void hmac_tag(const hmac_key *k, const unsigned char *body, size_t len,
                     unsigned char out[TAG]) {
    SHA256_CTX c = k->inner;
    unsigned char inner[TAG];
    SHA256_Update(&c, body, len);
    SHA256_Final(inner, &c);
    c = k->outer;
    SHA256_Update(&c, inner, TAG);
    SHA256_Final(out, &c);
}

/* Keys from a tuple of bytes (0..MAX_KEYS); returns the count or -1. */
static int prepare_keys(hmac_key *keys, PyObject *tuple) {
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (n > MAX_KEYS) {
        PyErr_Format(PyExc_ValueError, "need 0..%d keys, got %zd", MAX_KEYS, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (prepare_key(&keys[i], PyTuple_GET_ITEM(tuple, i)) < 0)
            return -1;
    return (int)n;
}

/* The hmac_key inside a bytes object made by hmac_state(), or NULL (ValueError). The bytes
 * are only read: copying them out keeps the alignment of the SHA-256 states right. */
static const hmac_key *state_of(PyObject *obj) {
    static __thread hmac_key states[MAX_BATCH + 1];
    static __thread int next;
    if (!PyBytes_Check(obj) || PyBytes_GET_SIZE(obj) != (Py_ssize_t)sizeof(hmac_key)) {
        PyErr_SetString(PyExc_ValueError, "not an HMAC state from hmac_state()");
        return NULL;
    }
    hmac_key *k = &states[next];
    next = (next + 1) % (MAX_BATCH + 1);
    memcpy(k, PyBytes_AS_STRING(obj), sizeof *k);
    return k;
}

static PyObject *address_tuple(const struct sockaddr_storage *sa) {
    char host[INET6_ADDRSTRLEN];
    int port;
    if (sa->ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
        port = ntohs(in->sin_port);
    } else if (sa->ss_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
        port = ntohs(in6->sin6_port);
    } else {
        host[0] = '\0';
        port = 0;
    }
    return Py_BuildValue("(si)", host, port);
}

PyDoc_STRVAR(recv_batch_doc,
"recv_batch(fd, keys, prefix, min_size, max_size, wait) -> list[(data, (host, port), signed)]\n\n"
"Read up to 64 datagrams from the UDP socket fd with one recvmmsg. wait=True blocks\n"
"(GIL released) until one arrives, wait=False returns [] when none is pending. For each\n"
"datagram that starts with prefix and is min_size..max_size bytes long, signed is the\n"
"index in keys of the key whose HMAC-SHA256 matches its last 32 bytes, or -1; for any\n"
"other datagram, and for every one when keys is empty (the caller verifies, e.g. with the\n"
"key of the node a datagram names), it is -2 (not checked). Longer datagrams are\n"
"truncated to 1024 bytes.");

static PyObject *recv_batch(PyObject *self, PyObject *args) {
    int fd, wait;
    PyObject *key_tuple;
    const char *prefix;
    Py_ssize_t prefix_len, min_size, max_size;
    hmac_key keys[MAX_KEYS];
    static __thread unsigned char bufs[MAX_BATCH][SLOT];
    struct mmsghdr msgs[MAX_BATCH];
    struct iovec iov[MAX_BATCH];
    struct sockaddr_storage addrs[MAX_BATCH];
    int nkeys, n;

    if (!PyArg_ParseTuple(args, "iO!y#nnp", &fd, &PyTuple_Type, &key_tuple, &prefix,
                          &prefix_len, &min_size, &max_size, &wait))
        return NULL;
    if (min_size < TAG || max_size > SLOT || min_size > max_size || prefix_len > min_size) {
        PyErr_SetString(PyExc_ValueError, "need 32 <= min_size <= max_size <= 1024 and a "
                                          "prefix no longer than min_size");
        return NULL;
    }
    if ((nkeys = prepare_keys(keys, key_tuple)) < 0)
        return NULL;
    memset(msgs, 0, sizeof msgs);
    for (int i = 0; i < MAX_BATCH; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = SLOT;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_name = &addrs[i];
        msgs[i].msg_hdr.msg_namelen = sizeof addrs[i];
    }
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        n = recvmmsg(fd, msgs, MAX_BATCH, wait ? MSG_WAITFORONE : MSG_DONTWAIT, NULL);
        Py_END_ALLOW_THREADS
        if (n >= 0)
            break;
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return NULL;
            continue;
        }
        if (!wait && (errno == EAGAIN || errno == EWOULDBLOCK))
            return PyList_New(0);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        const unsigned char *data = bufs[i];
        size_t len = msgs[i].msg_len;
        int signed_by = -2;
        if (nkeys > 0 && (Py_ssize_t)len >= min_size && (Py_ssize_t)len <= max_size &&
            memcmp(data, prefix, (size_t)prefix_len) == 0) {
            unsigned char tag[TAG];
            signed_by = -1;
            for (int k = 0; k < nkeys && signed_by < 0; k++) {
                hmac_tag(&keys[k], data, len - TAG, tag);
                if (CRYPTO_memcmp(tag, data + len - TAG, TAG) == 0)
                    signed_by = k;
            }
        }
        PyObject *addr = address_tuple(&addrs[i]);
        PyObject *item = addr == NULL ? NULL
            : Py_BuildValue("(y#Ni)", (const char *)data, (Py_ssize_t)len, addr, signed_by);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static int parse_address(PyObject *host, int port, struct sockaddr_storage *sa,
                         socklen_t *len) {
    const char *text = PyUnicode_AsUTF8(host);
    if (text == NULL)
        return -1;
    memset(sa, 0, sizeof *sa);
    if (port < 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port %d outside 0..65535", port);
        return -1;
    }
    struct sockaddr_in *in = (struct sockaddr_in *)sa;
    if (inet_pton(AF_INET, text, &in->sin_addr) == 1) {
        in->sin_family = AF_INET;
        in->sin_port = htons((uint16_t)port);
        *len = sizeof *in;
        return 0;
    }
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)sa;
    if (inet_pton(AF_INET6, text, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons((uint16_t)port);
        *len = sizeof *in6;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "%R is not a numeric IPv4 or IPv6 address", host);
    return -1;
}

PyDoc_STRVAR(sign_send_doc,
"sign_send(fd, key, items) -> int\n\n"
"Append the HMAC-SHA256 tag under key to each body of items, a list of\n"
"(body, (host, port)) or (body, (host, port), state) with numeric addresses (state, from\n"
"hmac_state(), signs that item; key may then be None), and send them from the UDP socket\n"
"fd with\n"
"sendmmsg, never blocking. Returns how many the kernel refused (a full send buffer loses\n"
"a datagram, as a network would). Bodies longer than 992 bytes raise ValueError.");

static PyObject *sign_send(PyObject *self, PyObject *args) {
    int fd;
    PyObject *key_obj, *items;
    hmac_key key;
    static __thread unsigned char bufs[MAX_BATCH][SLOT];
    struct mmsghdr msgs[MAX_BATCH];
    struct iovec iov[MAX_BATCH];
    struct sockaddr_storage addrs[MAX_BATCH];
    long failures = 0;

    if (!PyArg_ParseTuple(args, "iOO!", &fd, &key_obj, &PyList_Type, &items))
        return NULL;
    if (key_obj != Py_None && !PyBytes_Check(key_obj)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes or None");
        return NULL;
    }
    if (key_obj != Py_None && prepare_key(&key, key_obj) < 0)
        return NULL;
    Py_ssize_t total = PyList_GET_SIZE(items);
    for (Py_ssize_t start = 0; start < total; start += MAX_BATCH) {
        int n = (int)(total - start < MAX_BATCH ? total - start : MAX_BATCH);
        memset(msgs, 0, sizeof msgs);
        for (int i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(items, start + i), *body, *host, *state = NULL;
            const hmac_key *signer = &key;
            int port;
            char *data;
            Py_ssize_t len;
            socklen_t addr_len;
            if (!PyTuple_Check(item)) {
                PyErr_SetString(PyExc_TypeError, "items must be (body, (host, port)) tuples");
                return NULL;
            }
            if (!PyArg_ParseTuple(item, "S(Ui)|S", &body, &host, &port, &state))
                return NULL;
            if (state != NULL) {
                if ((signer = state_of(state)) == NULL)
                    return NULL;
            } else if (key_obj == Py_None) {
                PyErr_SetString(PyExc_TypeError, "an item without its own key needs a key");
                return NULL;
            }
            if (PyBytes_AsStringAndSize(body, &data, &len) < 0)
                return NULL;
            if (len > SLOT - TAG) {
                PyErr_Format(PyExc_ValueError, "body of %zd bytes > %d", len, SLOT - TAG);
                return NULL;
            }
            if (parse_address(host, port, &addrs[i], &addr_len) < 0)
                return NULL;
            memcpy(bufs[i], data, (size_t)len);
            hmac_tag(signer, bufs[i], (size_t)len, bufs[i] + len);
            iov[i].iov_base = bufs[i];
            iov[i].iov_len = (size_t)len + TAG;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_name = &addrs[i];
            msgs[i].msg_hdr.msg_namelen = addr_len;
        }
        int done = 0;
        Py_BEGIN_ALLOW_THREADS
        while (done < n) {
            int r = sendmmsg(fd, msgs + done, (unsigned)(n - done), MSG_DONTWAIT);
            if (r < 0) {
                if (errno == EINTR)
                    continue;
                failures++; /* the first of the rest failed: skip it, send the others */
                done++;
            } else {
                done += r;
            }
        }
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(failures);
}

PyDoc_STRVAR(hmac_state_doc,
"hmac_state(key) -> bytes\n\n"
"The precomputed HMAC-SHA256 state of key (its two padded blocks hashed), for verify()\n"
"and as a sign_send item's signer: a per-node key then costs no key schedule per\n"
"datagram. As secret as the key.");

static PyObject *hmac_state(PyObject *self, PyObject *args) {
    PyObject *key_obj;
    hmac_key key;
    if (!PyArg_ParseTuple(args, "S", &key_obj))
        return NULL;
    if (prepare_key(&key, key_obj) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize((const char *)&key, sizeof key);
    OPENSSL_cleanse(&key, sizeof key);
    return out;
}

PyDoc_STRVAR(verify_doc,
"verify(state, data) -> bool\n\n"
"True if the last 32 bytes of data are the HMAC-SHA256, under the key of state\n"
"(hmac_state()), of the bytes before them (constant-time compare).");

static PyObject *verify(PyObject *self, PyObject *args) {
    PyObject *state;
    const char *data;
    Py_ssize_t len;
    const hmac_key *k;
    unsigned char tag[TAG];
    if (!PyArg_ParseTuple(args, "Sy#", &state, &data, &len))
        return NULL;
    if ((k = state_of(state)) == NULL)
        return NULL;
    if (len < TAG)
        Py_RETURN_FALSE;
    hmac_tag(k, (const unsigned char *)data, (size_t)(len - TAG), tag);
    return PyBool_FromLong(CRYPTO_memcmp(tag, data + len - TAG, TAG) == 0);
}

PyDoc_STRVAR(tag_doc, "tag(key, body) -> bytes\n\nHMAC-SHA256 of body under key (for tests).");

static PyObject *tag(PyObject *self, PyObject *args) {
    PyObject *key_obj;
    const char *body;
    Py_ssize_t len;
    hmac_key key;
    unsigned char out[TAG];
    if (!PyArg_ParseTuple(args, "Sy#", &key_obj, &body, &len))
        return NULL;
    if (prepare_key(&key, key_obj) < 0)
        return NULL;
    hmac_tag(&key, (const unsigned char *)body, (size_t)len, out);
    return PyBytes_FromStringAndSize((const char *)out, TAG);
}

static PyMethodDef methods[] = {
    {"recv_batch", recv_batch, METH_VARARGS, recv_batch_doc},
    {"sign_send", sign_send, METH_VARARGS, sign_send_doc},
    {"tag", tag, METH_VARARGS, tag_doc},
    {"hmac_state", hmac_state, METH_VARARGS, hmac_state_doc},
    {"verify", verify, METH_VARARGS, verify_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "raps_slurm.wire._udp",
    "Batched UDP receive/send with HMAC-SHA256 tags (the heartbeat path).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__udp(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "MAX_BATCH", MAX_BATCH) < 0 ||
                      PyModule_AddIntConstant(m, "TAG_BYTES", TAG) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
