/* The agent's local API from C: length-prefixed JSON frames over its unix socket,
 * descriptors passed with SCM_RIGHTS, as raps_slurm/runtime/agent_client.py speaks it. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "raps.h"
#include "raps_int.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void raps__conn_init(struct raps_conn *c, const char *path) {
  c->fd = -1;
  snprintf(c->path, sizeof c->path, "%s", path);
}

void raps__conn_close(struct raps_conn *c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
}

void raps__reply_free(struct raps_reply *r) {
  free(r->body);
  r->body = NULL;
  for (int i = 0; i < r->nfds; i++) close(r->fds[i]);
  r->nfds = 0;
}

/* Wait until fd is ready for events or the deadline passed; 0 ready, -1 timed out. */
static int wait_fd(int fd, short events, double deadline) {
  for (;;) {
    double left = deadline - now_s();
    if (left <= 0) return -1;
    struct pollfd p = {.fd = fd, .events = events};
    int n = poll(&p, 1, (int)(left * 1000) + 1);
    if (n > 0) return 0;
    if (n < 0 && errno != EINTR) return -1;
  }
}

static int connect_agent(struct raps_conn *c) {
  if (c->fd >= 0) {
    /* Nothing is ever due from the agent between requests: readable means it hung up
     * (it closes connections idle for a minute). */
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    if (poll(&p, 1, 0) == 0) return RAPS_OK;
    raps__conn_close(c);
  }
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(c->path) >= sizeof addr.sun_path)
    return raps__fail(RAPS_ERR_ENV, "agent socket path %s: longer than %zu bytes", c->path,
                      sizeof addr.sun_path - 1);
  memcpy(addr.sun_path, c->path, strlen(c->path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return raps__fail(RAPS_ERR_SYSTEM, "socket: %s", strerror(errno));
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    int e = errno;
    close(fd);
    return raps__fail(RAPS_ERR_NO_AGENT, "cannot reach the agent at %s: %s", c->path,
                      strerror(e));
  }
  c->fd = fd;
  return RAPS_OK;
}

static int send_all(int fd, const char *buf, size_t n, const int *fds, int nfds,
                    double deadline) {
  size_t done = 0;
  while (done < n) {
    if (wait_fd(fd, POLLOUT, deadline) != 0) return -1;
    struct iovec iov = {.iov_base = (char *)buf + done, .iov_len = n - done};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    if (done == 0 && nfds > 0) {
      memset(cbuf, 0, sizeof cbuf);
      msg.msg_control = cbuf;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
      struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
      memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -1;
    }
    done += (size_t)k;
  }
  return 0;
}

/* Read exactly n bytes, keeping descriptors that arrive; 0, -1 (error), -2 (timeout). */
static int recv_all(int fd, char *buf, size_t n, struct raps_reply *r, double deadline) {
  size_t got = 0;
  while (got < n) {
    if (wait_fd(fd, POLLIN, deadline) != 0) return -2;
    struct iovec iov = {.iov_base = buf + got, .iov_len = n - got};
    char cbuf[CMSG_SPACE(sizeof(int) * 8)];
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                         .msg_controllen = sizeof cbuf};
    ssize_t k = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -1;
    }
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      int *in = (int *)CMSG_DATA(cm);
      for (size_t i = 0; i < count; i++) {
        if (r->nfds < 4) r->fds[r->nfds++] = in[i];
        else close(in[i]);
      }
    }
    if (k == 0) return -1;
    got += (size_t)k;
  }
  return 0;
}

int raps__kind_code(const char *kind) {
  static const struct { const char *kind; int code; } map[] = {
      {"permission", RAPS_ERR_PERMISSION}, {"not_registered", RAPS_ERR_WRONG_JOB},
      {"epoch", RAPS_ERR_WRONG_JOB},       {"unknown_job", RAPS_ERR_WRONG_JOB},
      {"node", RAPS_ERR_WRONG_JOB},
      {"quota", RAPS_ERR_QUOTA},           {"size", RAPS_ERR_QUOTA},
      {"lost", RAPS_ERR_LOST},             {"no_generation", RAPS_ERR_NO_CHECKPOINT},
  };
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
    if (strcmp(kind, map[i].kind) == 0) return map[i].code;
  return RAPS_ERR_REFUSED;
}

int raps__call(struct raps_conn *c, const char *json, const int *fds, int nfds,
               double timeout_s, struct raps_reply *out) {
  memset(out, 0, sizeof *out);
  size_t n = strlen(json);
  if (n == 0 || n > RAPS_MAX_REQUEST)
    return raps__fail(RAPS_ERR_ARG, "request of %zu bytes: must be 1..%d", n,
                      RAPS_MAX_REQUEST);
  int rc = connect_agent(c);
  if (rc != RAPS_OK) return rc;
  double deadline = now_s() + timeout_s;
  char *frame = malloc(n + 4);
  if (!frame) return raps__fail(RAPS_ERR_SYSTEM, "out of memory");
  frame[0] = (char)(n >> 24), frame[1] = (char)(n >> 16), frame[2] = (char)(n >> 8);
  frame[3] = (char)n;
  memcpy(frame + 4, json, n);
  int bad = send_all(c->fd, frame, n + 4, fds, nfds, deadline);
  free(frame);
  if (bad) {
    raps__conn_close(c);
    return raps__fail(RAPS_ERR_NO_AGENT, "request to the agent at %s failed: %s", c->path,
                      errno ? strerror(errno) : "timed out");
  }
  unsigned char head[4];
  int got = recv_all(c->fd, (char *)head, 4, out, deadline);
  size_t len = 0;
  if (got == 0) {
    len = (size_t)head[0] << 24 | (size_t)head[1] << 16 | (size_t)head[2] << 8 | head[3];
    if (len < 1 || len > RAPS_MAX_REQUEST) got = -3;
  }
  if (got == 0) {
    out->body = malloc(len + 1);
    if (!out->body) got = -1;
    else got = recv_all(c->fd, out->body, len, out, deadline);
  }
  if (got != 0) {
    /* The stream is unusable: a late reply would be taken for the next request's. */
    raps__conn_close(c);
    raps__reply_free(out);
    if (got == -3) return raps__fail(RAPS_ERR_PROTOCOL, "reply length %zu outside 1..%d",
                                     len, RAPS_MAX_REQUEST);
    return raps__fail(RAPS_ERR_NO_AGENT, "no reply from the agent at %s %s", c->path,
                      got == -2 ? "in time" : "(connection closed)");
  }
  out->body[len] = 0;
  out->len = len;
  int ok = 0;
  if (!raps__json_bool(out->body, len, "ok", &ok)) {
    raps__reply_free(out);
    return raps__fail(RAPS_ERR_PROTOCOL, "malformed reply: no boolean 'ok'");
  }
  if (!ok) {
    char kind[64] = "", error[512] = "";
    raps__json_str(out->body, len, "kind", kind, sizeof kind);
    raps__json_str(out->body, len, "error", error, sizeof error);
    raps__reply_free(out);
    int code = raps__kind_code(kind);
    rc = raps__fail(code, "the agent refused (%s): %s", kind[0] ? kind : "?", error);
    raps__set_kind(kind);
    return rc;
  }
  return RAPS_OK;
}

/* --- JSON: just enough to read the agent's replies (objects, strings, numbers) --- */

static const char *skip_ws(const char *p, const char *end) {
  while (p < end && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')) p++;
  return p;
}

static const char *skip_string(const char *p, const char *end) {
  for (p++; p < end; p++) {
    if (*p == '\\') p++;
    else if (*p == '"') return p + 1;
  }
  return NULL;
}

static const char *skip_value(const char *p, const char *end, int depth) {
  p = skip_ws(p, end);
  if (p >= end || depth > 64) return NULL;
  if (*p == '"') return skip_string(p, end);
  if (*p == '{' || *p == '[') {
    char close = *p == '{' ? '}' : ']';
    p = skip_ws(p + 1, end);
    if (p < end && *p == close) return p + 1;
    for (;;) {
      if (close == '}') {
        p = skip_ws(p, end);
        if (p >= end || *p != '"' || !(p = skip_string(p, end))) return NULL;
        p = skip_ws(p, end);
        if (p >= end || *p++ != ':') return NULL;
      }
      if (!(p = skip_value(p, end, depth + 1))) return NULL;
      p = skip_ws(p, end);
      if (p >= end) return NULL;
      if (*p == close) return p + 1;
      if (*p++ != ',') return NULL;
    }
  }
  while (p < end && (strchr("+-.eE0123456789", *p) || (*p >= 'a' && *p <= 'z'))) p++;
  return p;
}

int raps__json_get(const char *text, size_t n, const char *key, const char **v, size_t *vn) {
  const char *p = skip_ws(text, text + n), *end = text + n;
  size_t klen = strlen(key);
  if (p >= end || *p++ != '{') return 0;
  for (;;) {
    p = skip_ws(p, end);
    if (p >= end || *p != '"') return 0;
    const char *k = p + 1, *after = skip_string(p, end);
    if (!after) return 0;
    int match = (size_t)(after - 1 - k) == klen && memcmp(k, key, klen) == 0;
    p = skip_ws(after, end);
    if (p >= end || *p++ != ':') return 0;
    p = skip_ws(p, end);
    const char *val_end = skip_value(p, end, 0);
    if (!val_end) return 0;
    if (match) {
      *v = p, *vn = (size_t)(val_end - p);
      return 1;
    }
    p = skip_ws(val_end, end);
    if (p >= end || *p++ != ',') return 0;
  }
}

/* The value of key as NUL-terminated text in buf (numbers, true/false/null). */
static int value_text(const char *text, size_t n, const char *key, char *buf, size_t cap) {
  const char *v;
  size_t vn;
  if (!raps__json_get(text, n, key, &v, &vn) || vn == 0 || vn >= cap) return 0;
  memcpy(buf, v, vn);
  buf[vn] = 0;
  return 1;
}

int raps__json_long(const char *text, size_t n, const char *key, long long *out) {
  char buf[32], *e;
  if (!value_text(text, n, key, buf, sizeof buf)) return 0;
  errno = 0;
  long long x = strtoll(buf, &e, 10);
  if (*e || errno) return 0;
  *out = x;
  return 1;
}

int raps__json_double(const char *text, size_t n, const char *key, double *out) {
  char buf[48], *e;
  if (!value_text(text, n, key, buf, sizeof buf)) return 0;
  double x = strtod(buf, &e);
  if (*e) return 0;
  *out = x;
  return 1;
}

int raps__json_bool(const char *text, size_t n, const char *key, int *out) {
  const char *v;
  size_t vn;
  if (!raps__json_get(text, n, key, &v, &vn)) return 0;
  if (vn == 4 && memcmp(v, "true", 4) == 0) *out = 1;
  else if (vn == 5 && memcmp(v, "false", 5) == 0) *out = 0;
  else return 0;
  return 1;
}

int raps__json_is_null(const char *text, size_t n, const char *key) {
  const char *v;
  size_t vn;
  return raps__json_get(text, n, key, &v, &vn) && vn == 4 && memcmp(v, "null", 4) == 0;
}

int raps__json_str(const char *text, size_t n, const char *key, char *out, size_t cap) {
  const char *v;
  size_t vn, o = 0;
  if (cap == 0 || !raps__json_get(text, n, key, &v, &vn) || vn < 2 || *v != '"') return 0;
  for (size_t i = 1; i + 1 < vn && o + 1 < cap; i++) {
    char ch = v[i];
    if (ch == '\\' && i + 2 < vn) {
      ch = v[++i];
      if (ch == 'n') ch = '\n';
      else if (ch == 't') ch = '\t';
      else if (ch == 'u') { /* non-ASCII in a message: shown as '?' */
        i += 4;
        ch = '?';
      }
    }
    out[o++] = ch;
  }
  out[o] = 0;
  return 1;
}
