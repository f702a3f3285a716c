/*
 * A worker that costs next to nothing per request, for benchmarks/scaling.py.
 *
 * The Python mock workers spend more CPU per request than the gateway does, so on
 * a small machine they, not the gateway, set the pace, and a second gateway
 * process shows no gain. This one answers every request with a fixed body in
 * the OpenAI shape (usage included, so the gateway's accounting runs as usual):
 * one epoll loop, keep-alive, Content-Length framing only (what meshkit sends).
 *
 *   backend PORT        listens on 127.0.0.1:PORT until killed
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_REQUEST (4 << 20) /* a request larger than this closes its connection */

static const char CHAT[] =
    "{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion\",\"created\":1700000000,"
    "\"model\":\"mock-model\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\","
    "\"content\":\"ok\"},\"finish_reason\":\"stop\"}],"
    "\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":1,\"total_tokens\":9}}";
static const char COMPLETION[] =
    "{\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":1700000000,"
    "\"model\":\"mock-model\",\"choices\":[{\"index\":0,\"text\":\"ok\",\"finish_reason\":\"stop\"}],"
    "\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":1,\"total_tokens\":9}}";
static const char MODELS[] =
    "{\"object\":\"list\",\"data\":[{\"id\":\"mock-model\",\"object\":\"model\","
    "\"owned_by\":\"meshbench\"}]}";
static const char HEALTH[] = "{}";

struct conn {
    int fd;
    char *in;
    size_t len, cap;
    char *out;
    size_t out_len, out_off;
    int polling_out; /* EPOLLOUT is registered */
};

static void fail(const char *what) {
    perror(what);
    exit(1);
}

static void drop(int ep, struct conn *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

/* The value of a Content-Length field in head[0:n], or 0. */
static size_t content_length(const char *head, size_t n) {
    static const char name[] = "\r\ncontent-length:";
    size_t k = sizeof(name) - 1;
    for (size_t i = 0; i + k <= n; i++) {
        if (strncasecmp(head + i, name, k) == 0) {
            return (size_t)strtoull(head + i + k, NULL, 10);
        }
    }
    return 0;
}

static const char *answer_for(const char *head, int *status) {
    *status = 200;
    const char *path = strchr(head, ' ');
    if (path == NULL) {
        *status = 400;
        return HEALTH;
    }
    path++;
    if (strncmp(path, "/v1/chat/completions", 20) == 0) return CHAT;
    if (strncmp(path, "/v1/completions", 15) == 0) return COMPLETION;
    if (strncmp(path, "/v1/models", 10) == 0) return MODELS;
    if (strncmp(path, "/health", 7) == 0) return HEALTH;
    *status = 404;
    return HEALTH;
}

/* Queue the answers to every complete request in c->in; 0: keep the connection. */
static int serve(struct conn *c) {
    size_t at = 0;
    while (1) {
        char *start = c->in + at;
        size_t avail = c->len - at;
        char *end = memmem(start, avail, "\r\n\r\n", 4);
        if (end == NULL) break;
        size_t head = (size_t)(end - start) + 4;
        size_t body = content_length(start, head);
        if (head + body > MAX_REQUEST) return -1;
        if (avail < head + body) break;
        char saved = start[head - 1];
        start[head - 1] = '\0';
        int status;
        const char *text = answer_for(start, &status);
        start[head - 1] = saved;
        char buf[1024];
        int n = snprintf(buf, sizeof buf,
                         "HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                         "content-length: %zu\r\n\r\n%s",
                         status, status == 200 ? "OK" : "Not Found", strlen(text), text);
        char *grown = realloc(c->out, c->out_len + (size_t)n);
        if (grown == NULL) return -1;
        c->out = grown;
        memcpy(c->out + c->out_len, buf, (size_t)n);
        c->out_len += (size_t)n;
        at += head + body;
    }
    if (at > 0) {
        memmove(c->in, c->in + at, c->len - at);
        c->len -= at;
    }
    return 0;
}

/* Write what is queued; 1: some is left (wait for EPOLLOUT), -1: the peer is gone. */
static int flush(struct conn *c) {
    while (c->out_off < c->out_len) {
        ssize_t w = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
        if (w < 0) {
            if (errno == EAGAIN) return 1;
            if (errno == EINTR) continue;
            return -1;
        }
        c->out_off += (size_t)w;
    }
    c->out_len = c->out_off = 0;
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: backend PORT\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (lfd < 0) fail("socket");
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((unsigned short)atoi(argv[1]));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0) fail("bind");
    if (listen(lfd, 1024) < 0) fail("listen");
    int ep = epoll_create1(0);
    if (ep < 0) fail("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev) < 0) fail("epoll_ctl");
    struct epoll_event events[256];
    while (1) {
        int n = epoll_wait(ep, events, 256, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            struct conn *c = events[i].data.ptr;
            if (c == NULL) {
                int fd;
                while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct conn *nc = calloc(1, sizeof *nc);
                    if (nc == NULL) fail("calloc");
                    nc->fd = fd;
                    nc->cap = 65536;
                    nc->in = malloc(nc->cap);
                    if (nc->in == NULL) fail("malloc");
                    struct epoll_event cev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &cev);
                }
                continue;
            }
            if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                /* Level-triggered: one read per wake-up (a short read drained the
                 * socket; what is left wakes the loop again), not a read to EAGAIN. */
                if (c->len == c->cap) {
                    char *grown = c->cap < MAX_REQUEST ? realloc(c->in, c->cap * 2) : NULL;
                    if (grown == NULL) {
                        drop(ep, c);
                        continue;
                    }
                    c->in = grown;
                    c->cap *= 2;
                }
                ssize_t r = read(c->fd, c->in + c->len, c->cap - c->len);
                if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                if (r <= 0) {
                    drop(ep, c);
                    continue;
                }
                c->len += (size_t)r;
                if (serve(c) < 0) {
                    drop(ep, c);
                    continue;
                }
            }
            int left = flush(c);
            if (left < 0) {
                drop(ep, c);
                continue;
            }
            if (left != c->polling_out) {
                struct epoll_event cev = {.events = EPOLLIN | (left ? EPOLLOUT : 0), .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &cev);
                c->polling_out = left;
            }
        }
    }
}
