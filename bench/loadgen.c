/* A small HTTP/1.1 load generator for bench/serving.py (compiled there with gcc at run time).

   One thread, epoll, non-blocking keep-alive connections on loopback, one request in flight per
   connection (no pipelining). Request bodies come from a file, one per line, sent in turn.

   Modes:
     rate R     open loop: request k is due at start + k / R; it goes out on an idle connection
                (a new one is opened while fewer than --max-conns are) and its latency runs from
                the time it was DUE, not sent, so a server that falls behind is charged for the
                queue it causes (no coordinated omission).
     conns N    closed loop: N connections, each sends its next request when answered.

   Output: one JSON object on stdout: requests answered, errors (non-2xx, broken connections),
   timeouts (unanswered at the end), elapsed seconds, achieved rate, latency percentiles in ms
   (-1 when nothing was answered).

   usage: loadgen --port P --path /v1/models/dlrm:predict --bodies FILE
                  (--rate R | --conns N) --seconds S [--max-conns M] [--content-type T]
                  [--timeout S] [--host 127.0.0.1]
*/
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUF 65536

typedef struct {
    int fd;
    int busy;          /* a request is in flight */
    double start;      /* when its latency started (due time or send time) */
    const char *req;   /* the request bytes */
    size_t len, sent;
    char buf[BUF];
    size_t got;        /* bytes in buf */
    long body_left;    /* after the headers: body bytes still to come (-1: headers not complete) */
    int status;
} Conn;

static struct sockaddr_in addr;
static int ep;
static Conn *conns;
static int nconns, max_conns;
static char **reqs;
static size_t *req_lens;
static int nreqs;
static double *lat;
static long nlat, cap_lat;
static long errors;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

static int open_conn(Conn *c) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) { /* loopback: immediate */
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, O_NONBLOCK);
    c->fd = fd;
    c->busy = 0;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0) die("epoll_ctl");
    return 0;
}

static void record(double seconds) {
    if (nlat == cap_lat) {
        cap_lat = cap_lat ? 2 * cap_lat : 1 << 16;
        lat = realloc(lat, cap_lat * sizeof *lat);
        if (!lat) die("realloc");
    }
    lat[nlat++] = seconds;
}

static void drop(Conn *c) { /* a broken connection: the request in flight is an error */
    if (c->busy) errors++;
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    c->busy = 0;
}

static void flush_out(Conn *c) {
    while (c->sent < c->len) {
        ssize_t n = send(c->fd, c->req + c->sent, c->len - c->sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
                return;
            }
            drop(c);
            return;
        }
        c->sent += n;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

static int start_request(Conn *c, int k, double start) {
    if (c->fd < 0 && open_conn(c) < 0) {
        errors++;
        return -1;
    }
    c->busy = 1;
    c->start = start;
    c->req = reqs[k % nreqs];
    c->len = req_lens[k % nreqs];
    c->sent = 0;
    c->got = 0;
    c->body_left = -1;
    flush_out(c);
    return c->fd < 0 ? -1 : 0; /* a send that failed is counted as an error by drop() */
}

/* Reads what arrived; returns 1 when the response is complete. */
static int read_in(Conn *c) {
    for (;;) {
        ssize_t n = recv(c->fd, c->buf + c->got, BUF - 1 - c->got, 0);
        if (n == 0) {
            drop(c);
            return 0;
        }
        if (n < 0) {
            if (errno == EAGAIN) return 0;
            drop(c);
            return 0;
        }
        if (c->body_left >= 0) { /* headers done: count body bytes */
            c->body_left -= n;
            c->got = 0;
        } else {
            c->got += n;
            c->buf[c->got] = 0;
            char *end = strstr(c->buf, "\r\n\r\n");
            if (!end) {
                if (c->got >= BUF - 1) { drop(c); return 0; }
                continue;
            }
            c->status = atoi(c->buf + 9); /* "HTTP/1.1 200" */
            long length = -1;
            for (char *p = c->buf; p < end; p++) {
                if ((p == c->buf || p[-1] == '\n') && strncasecmp(p, "content-length:", 15) == 0) {
                    length = atol(p + 15);
                    break;
                }
            }
            if (length < 0) { drop(c); return 0; } /* only Content-Length responses are read */
            c->body_left = length - (long)(c->got - (end + 4 - c->buf));
            c->got = 0;
        }
        if (c->body_left <= 0) return 1;
    }
}

static char *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) die(path);
    fseek(f, 0, SEEK_END);
    *size = ftell(f);
    rewind(f);
    char *data = malloc(*size + 1);
    if (fread(data, 1, *size, f) != *size) die("read");
    data[*size] = 0;
    fclose(f);
    return data;
}

static void build_requests(const char *file, const char *host, int port, const char *path, const char *type) {
    size_t size;
    char *data = read_file(file, &size);
    int cap = 1024;
    reqs = malloc(cap * sizeof *reqs);
    req_lens = malloc(cap * sizeof *req_lens);
    for (char *line = data; line < data + size;) {
        char *nl = memchr(line, '\n', data + size - line);
        size_t n = nl ? (size_t)(nl - line) : (size_t)(data + size - line);
        if (n > 0) {
            if (nreqs == cap) {
                cap *= 2;
                reqs = realloc(reqs, cap * sizeof *reqs);
                req_lens = realloc(req_lens, cap * sizeof *req_lens);
            }
            char head[1024];
            int h = snprintf(head, sizeof head,
                             "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: %s\r\nContent-Length: %zu\r\n\r\n",
                             path, host, port, type, n);
            reqs[nreqs] = malloc(h + n);
            memcpy(reqs[nreqs], head, h);
            memcpy(reqs[nreqs] + h, line, n);
            req_lens[nreqs++] = h + n;
        }
        line += n + 1;
    }
    if (nreqs == 0) {
        fprintf(stderr, "loadgen: no bodies in %s\n", file);
        exit(2);
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double q) {
    if (nlat == 0) return -1;
    long i = (long)ceil(q / 100.0 * nlat) - 1;
    if (i < 0) i = 0;
    return 1e3 * lat[i];
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1", *path = "/", *bodies = NULL, *type = "application/json";
    int port = 8000, nc = 0;
    double rate = 0, seconds = 5, timeout = 10;
    max_conns = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--host")) host = v;
        else if (!strcmp(k, "--port")) port = atoi(v);
        else if (!strcmp(k, "--path")) path = v;
        else if (!strcmp(k, "--bodies")) bodies = v;
        else if (!strcmp(k, "--content-type")) type = v;
        else if (!strcmp(k, "--rate")) rate = atof(v);
        else if (!strcmp(k, "--conns")) nc = atoi(v);
        else if (!strcmp(k, "--seconds")) seconds = atof(v);
        else if (!strcmp(k, "--timeout")) timeout = atof(v);
        else if (!strcmp(k, "--max-conns")) max_conns = atoi(v);
        else { fprintf(stderr, "loadgen: unknown option %s\n", k); return 2; }
    }
    if (!bodies || (rate <= 0) == (nc <= 0)) {
        fprintf(stderr, "usage: loadgen --port P --path PATH --bodies FILE (--rate R | --conns N) --seconds S\n");
        return 2;
    }
    build_requests(bodies, host, port, path, type);
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) { fprintf(stderr, "loadgen: bad host %s\n", host); return 2; }
    ep = epoll_create1(0);
    if (nc > max_conns) max_conns = nc;
    conns = calloc(max_conns, sizeof *conns);
    for (int i = 0; i < max_conns; i++) conns[i].fd = -1;

    long total = rate > 0 ? (long)(rate * seconds) : -1; /* open loop: requests to send */
    long next = 0, in_flight = 0;
    double t0 = now() + 0.01, stop = t0 + seconds, give_up = stop + timeout;
    if (nc > 0) {
        nconns = nc;
        for (int i = 0; i < nc; i++) {
            if (start_request(&conns[i], (int)next, now()) == 0) in_flight++;
            next++;
        }
    }
    struct epoll_event events[256];
    for (;;) {
        double t = now();
        if (rate > 0) { /* dispatch every due request to an idle (or a new) connection */
            while (next < total && t0 + next / rate <= t) {
                Conn *c = NULL;
                for (int i = 0; i < nconns; i++)
                    if (!conns[i].busy) { c = &conns[i]; break; }
                if (!c && nconns < max_conns) c = &conns[nconns++];
                if (!c) break; /* every connection busy: it waits, its latency running */
                if (start_request(c, (int)next, t0 + next / rate) == 0) in_flight++;
                next++;
            }
            if (next >= total && in_flight == 0) break;
        } else if (t >= stop && in_flight == 0) {
            break;
        }
        if (t > give_up) break;
        int wait_ms = 50;
        if (rate > 0 && next < total) {
            double due = t0 + next / rate - t;
            wait_ms = due <= 0 ? 1 : (int)ceil(due * 1e3);
        }
        int n = epoll_wait(ep, events, 256, wait_ms);
        for (int e = 0; e < n; e++) {
            Conn *c = events[e].data.ptr;
            if (c->fd < 0) continue;
            if (events[e].events & EPOLLOUT) flush_out(c);
            if (c->fd < 0) { in_flight--; goto next_conn; }
            if (!(events[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) continue;
            int done = read_in(c);
            if (c->fd < 0) { in_flight--; goto next_conn; }
            if (!done) continue;
            double end = now();
            record(end - c->start);
            if (c->status < 200 || c->status >= 300) errors++;
            c->busy = 0;
            in_flight--;
            if (nc > 0 && end < stop) {
                if (start_request(c, (int)next, end) == 0) in_flight++;
                next++;
            }
            continue;
        next_conn: /* closed loop: a broken connection is replaced */
            if (nc > 0 && now() < stop) {
                if (start_request(c, (int)next, now()) == 0) in_flight++;
                next++;
            }
        }
    }
    double elapsed = now() - t0;
    long timeouts = in_flight + (rate > 0 ? total - next : 0);
    qsort(lat, nlat, sizeof *lat, cmp);
    double sum = 0;
    for (long i = 0; i < nlat; i++) sum += lat[i];
    printf("{\"mode\": \"%s\", \"rate\": %g, \"conns\": %d, \"requests\": %ld, \"errors\": %ld, \"timeouts\": %ld, "
           "\"elapsed_s\": %.3f, \"achieved_rps\": %.1f, \"mean_ms\": %.3f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, "
           "\"p99_ms\": %.3f, \"max_ms\": %.3f, \"connections\": %d}\n",
           rate > 0 ? "rate" : "conns", rate, nc, nlat, errors, timeouts, elapsed, nlat / elapsed,
           nlat ? 1e3 * sum / nlat : -1, pct(50), pct(90), pct(99), nlat ? 1e3 * lat[nlat - 1] : -1, nconns);
    return 0;
}
