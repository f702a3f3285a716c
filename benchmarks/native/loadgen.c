/*
 * A closed-loop HTTP/1.1 load generator that costs next to nothing per request,
 * for benchmarks/scaling.py (benchmarks/loadgen.py, in Python, spends about as
 * much CPU per request as the gateway it measures).
 *
 * CONNS keep-alive connections each send one POST, wait for the whole answer
 * (Content-Length framing: what meshkit relays from a worker that sends it), and
 * send the next, for SECONDS; then the answers still due are awaited (at most 5 s).
 * Prints one JSON object: answers by status class, wall time, its own CPU time.
 *
 *   loadgen PORT CONNS SECONDS PATH BODY_FILE
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_ANSWER (1 << 20)

struct conn {
    int fd;
    char *in;
    size_t len, cap;
    size_t sent; /* bytes of the request written */
    int busy;    /* a request is out */
    int polling_out; /* EPOLLOUT is registered: the request did not fit the socket */
};

static char *request;
static size_t request_len;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

static void fail(const char *what) {
    perror(what);
    exit(1);
}

/* Write what the socket takes of the rest of the request, and wait for it to
 * take more (EPOLLOUT) while some is left; -1: the connection failed. */
static int push(int ep, struct conn *c) {
    while (c->sent < request_len) {
        ssize_t w = write(c->fd, request + c->sent, request_len - c->sent);
        if (w < 0) {
            if (errno == EAGAIN) break;
            if (errno == EINTR) continue;
            return -1;
        }
        c->sent += (size_t)w;
    }
    int left = c->sent < request_len;
    if (left != c->polling_out) {
        struct epoll_event ev = {.events = EPOLLIN | (left ? EPOLLOUT : 0), .data.ptr = c};
        if (epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev) < 0) return -1;
        c->polling_out = left;
    }
    return 0;
}

/* The status of a complete answer in c->in (removed from it), 0: not complete yet,
 * -1: not an answer this tool reads. */
static int answer(struct conn *c) {
    char *end = memmem(c->in, c->len, "\r\n\r\n", 4);
    if (end == NULL) return c->len >= MAX_ANSWER ? -1 : 0;
    size_t head = (size_t)(end - c->in) + 4;
    static const char name[] = "\r\ncontent-length:";
    size_t k = sizeof(name) - 1;
    long body = -1;
    for (size_t i = 0; i + k <= head; i++) {
        if (strncasecmp(c->in + i, name, k) == 0) {
            body = strtol(c->in + i + k, NULL, 10);
            break;
        }
    }
    if (body < 0 || body > MAX_ANSWER) return -1;
    if (c->len < head + (size_t)body) return 0;
    int status = c->len > 12 ? atoi(c->in + 9) : -1;
    size_t used = head + (size_t)body;
    memmove(c->in, c->in + used, c->len - used);
    c->len -= used;
    return status > 0 ? status : -1;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: loadgen PORT CONNS SECONDS PATH BODY_FILE\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int port = atoi(argv[1]), conns = atoi(argv[2]);
    double seconds = atof(argv[3]);
    FILE *f = fopen(argv[5], "rb");
    if (f == NULL) fail("body file");
    fseek(f, 0, SEEK_END);
    long body_len = ftell(f);
    fseek(f, 0, SEEK_SET);
    request = malloc((size_t)body_len + 512);
    if (request == NULL) fail("malloc");
    int head = snprintf(request, 512,
                        "POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                        "content-type: application/json\r\ncontent-length: %ld\r\n\r\n",
                        argv[4], port, body_len);
    if (fread(request + head, 1, (size_t)body_len, f) != (size_t)body_len) fail("fread");
    fclose(f);
    request_len = (size_t)head + (size_t)body_len;

    int ep = epoll_create1(0);
    if (ep < 0) fail("epoll_create1");
    struct conn *all = calloc((size_t)conns, sizeof *all);
    if (all == NULL) fail("calloc");
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((unsigned short)port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    for (int i = 0; i < conns; i++) {
        struct conn *c = &all[i];
        c->fd = socket(AF_INET, SOCK_STREAM, 0);
        if (c->fd < 0) fail("socket");
        if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) < 0) fail("connect");
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) | O_NONBLOCK) < 0) fail("fcntl");
        c->cap = 65536;
        c->in = malloc(c->cap);
        if (c->in == NULL) fail("malloc");
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev) < 0) fail("epoll_ctl");
    }
    long ok = 0, client_errors = 0, server_errors = 0, broken = 0, ok_in_window = -1;
    double cpu_in_window = 0;
    int out = 0;
    double start = now(), stop = start + seconds, deadline = stop + 5.0;
    for (int i = 0; i < conns; i++) {
        all[i].busy = 1;
        all[i].sent = 0;
        if (push(ep, &all[i]) < 0) fail("write");
        out++;
    }
    struct epoll_event events[256];
    while (out > 0) {
        double t = now();
        if (t >= deadline) break;
        int n = epoll_wait(ep, events, 256, 100);
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("epoll_wait");
        }
        int more = now() < stop;
        if (!more && ok_in_window < 0) {
            /* the window ends: what was answered in it, and the CPU it took */
            ok_in_window = ok;
            cpu_in_window = cpu_seconds();
        }
        for (int i = 0; i < n; i++) {
            struct conn *c = events[i].data.ptr;
            if (c->sent < request_len && push(ep, c) < 0) {
                broken++;
                out--;
                c->busy = 0;
                epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                continue;
            }
            if (c->len == c->cap) {
                char *grown = c->cap < 2 * MAX_ANSWER ? realloc(c->in, c->cap * 2) : NULL;
                if (grown == NULL) fail("an answer over the bound");
                c->in = grown;
                c->cap *= 2;
            }
            ssize_t r = read(c->fd, c->in + c->len, c->cap - c->len);
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (r <= 0) {
                broken++;
                out--;
                c->busy = 0;
                epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                continue;
            }
            c->len += (size_t)r;
            int status;
            while (c->busy && (status = answer(c)) != 0) {
                if (status < 0) {
                    broken++;
                } else if (status < 400) {
                    ok++;
                } else if (status < 500) {
                    client_errors++;
                } else {
                    server_errors++;
                }
                out--;
                c->busy = 0;
                if (status < 0) {
                    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                } else if (more) {
                    c->busy = 1;
                    c->sent = 0;
                    if (push(ep, c) < 0) {
                        broken++;
                        c->busy = 0;
                        epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                    } else {
                        out++;
                    }
                }
            }
        }
    }
    if (ok_in_window < 0) {
        ok_in_window = ok;
        cpu_in_window = cpu_seconds();
    }
    printf("{\"ok\": %ld, \"ok_in_window\": %ld, \"window_s\": %.6f, \"cpu_in_window_s\": %.6f, "
           "\"client_errors\": %ld, \"server_errors\": %ld, \"broken\": %ld, "
           "\"unanswered\": %d, \"cpu_s\": %.6f}\n",
           ok, ok_in_window, seconds, cpu_in_window, client_errors, server_errors, broken, out,
           cpu_seconds());
    return 0;
}
