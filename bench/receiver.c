/* receiver.c: the fleet benchmarks' subscriptions, read by one epoll loop (bench/receiver.py
 * builds and drives it).
 *
 * Why C: a push's propagation is measured at the subscriber. 4,000 subscriptions read by
 * one Python event loop took about 100 ms per push on this machine, where Redis spent 16 to
 * 30 ms writing it: the figures were the reader's. Here a subscription's read costs one
 * read(2) and a scan, and each arrival is stamped with CLOCK_MONOTONIC, the clock of
 * Python's time.perf_counter(), so the bench subtracts its own send times.
 *
 * usage: receiver CHANNEL N PORT [PORT ...]
 *   opens N connections to 127.0.0.1, subscription i on PORT[i % ports], each sends
 *   SUBSCRIBE CHANNEL; prints "ready" once every one is confirmed.
 * stdin, a line each:
 *   "dump": prints every arrival since the last dump, "NAME I T_NS" a line (the broker
 *           name of a push's "f":"NAME" field, the subscription, the time), then "end"
 *   "quit" (or end of input): exits
 * A subscription closed by the server is counted; "dump" ends with "end CLOSED".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TAIL 256          /* a push split between two reads keeps at most this much */
#define NAME_MAX_LEN 200  /* longer broker names are not recorded */

typedef struct {
  int fd;
  int confirmed;
  int closed;
  size_t tail_len;
  char tail[TAIL];
} sub_t;

typedef struct {
  long long t_ns;
  int sub;
  int len;
  char name[NAME_MAX_LEN];
} arrival_t;

static arrival_t *arrivals;
static size_t n_arrivals, cap_arrivals;
static int closed_count;

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void record(int sub, const char *name, int len, long long t) {
  if (n_arrivals == cap_arrivals) {
    cap_arrivals = cap_arrivals ? 2 * cap_arrivals : 65536;
    arrivals = realloc(arrivals, cap_arrivals * sizeof *arrivals);
    if (!arrivals) {
      perror("realloc");
      exit(3);
    }
  }
  arrival_t *a = &arrivals[n_arrivals++];
  a->t_ns = t;
  a->sub = sub;
  a->len = len;
  memcpy(a->name, name, (size_t)len);
}

/* Scan buf for "f":"NAME"; a match cut off at the end is kept in the tail for the next read. */
static void scan(sub_t *s, int idx, char *buf, size_t len, long long t) {
  static const char key[] = "\"f\":\"";
  size_t k = sizeof key - 1, i = 0, keep_from;
  if (!s->confirmed && memmem(buf, len, "subscribe", 9)) s->confirmed = 1;
  for (;;) {
    char *m = i < len ? memmem(buf + i, len - i, key, k) : NULL;
    if (!m) {
      /* the key itself may be cut at the end: keep what could be its start */
      keep_from = len > i + (k - 1) ? len - (k - 1) : i;
      break;
    }
    size_t start = (size_t)(m - buf) + k;
    char *q = memchr(buf + start, '"', len - start);
    if (!q) {
      keep_from = (size_t)(m - buf);
      break;
    }
    int n = (int)(q - (buf + start));
    if (n > 0 && n <= NAME_MAX_LEN) record(idx, buf + start, n, t);
    i = (size_t)(q - buf) + 1;
  }
  size_t rest = len - keep_from;
  if (rest > TAIL) rest = 0; /* a name too long to record: dropped */
  memmove(s->tail, buf + len - rest, rest);
  s->tail_len = rest;
}

static int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((unsigned short)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

static void dump(void) {
  for (size_t i = 0; i < n_arrivals; i++) {
    arrival_t *a = &arrivals[i];
    printf("%.*s %d %lld\n", a->len, a->name, a->sub, a->t_ns);
  }
  printf("end %d\n", closed_count);
  fflush(stdout);
  n_arrivals = 0;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: receiver CHANNEL N PORT [PORT ...]\n");
    return 2;
  }
  const char *channel = argv[1];
  int n = atoi(argv[2]);
  int n_ports = argc - 3;
  sub_t *subs = calloc((size_t)n, sizeof *subs);
  int ep = epoll_create1(0);
  char cmd[1024];
  int clen = snprintf(cmd, sizeof cmd, "*2\r\n$9\r\nSUBSCRIBE\r\n$%zu\r\n%s\r\n", strlen(channel),
                      channel);
  for (int i = 0; i < n; i++) {
    int fd = connect_to(atoi(argv[3 + i % n_ports]));
    if (fd < 0) {
      fprintf(stderr, "connect %d: %s\n", i, strerror(errno));
      return 4;
    }
    if (write(fd, cmd, (size_t)clen) != clen) {
      fprintf(stderr, "subscribe %d: %s\n", i, strerror(errno));
      return 4;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    subs[i].fd = fd;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (unsigned)i};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  }
  struct epoll_event ev0 = {.events = EPOLLIN, .data.u32 = (unsigned)n};
  epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev0);
  int confirmed = 0, ready_said = 0;
  static char buf[65536 + TAIL];
  char line[256];
  size_t line_len = 0;
  struct epoll_event evs[256];
  for (;;) {
    if (!ready_said && confirmed == n) {
      printf("ready\n");
      fflush(stdout);
      ready_said = 1;
    }
    int got = epoll_wait(ep, evs, 256, -1);
    if (got < 0) {
      if (errno == EINTR) continue;
      perror("epoll_wait");
      return 5;
    }
    long long t = now_ns();
    for (int e = 0; e < got; e++) {
      unsigned idx = evs[e].data.u32;
      if (idx == (unsigned)n) {
        ssize_t r = read(0, line + line_len, sizeof line - 1 - line_len);
        if (r <= 0) return 0;
        line_len += (size_t)r;
        char *nl;
        while ((nl = memchr(line, '\n', line_len))) {
          *nl = 0;
          if (!strcmp(line, "dump")) dump();
          else if (!strcmp(line, "quit")) return 0;
          size_t used = (size_t)(nl - line) + 1;
          memmove(line, nl + 1, line_len - used);
          line_len -= used;
        }
        if (line_len == sizeof line - 1) line_len = 0;
        continue;
      }
      sub_t *s = &subs[idx];
      for (;;) {
        memcpy(buf, s->tail, s->tail_len);
        ssize_t r = read(s->fd, buf + s->tail_len, 65536);
        if (r > 0) {
          int was = s->confirmed;
          scan(s, (int)idx, buf, s->tail_len + (size_t)r, t);
          if (!was && s->confirmed) confirmed++;
          if (r < 65536) break;
          continue;
        }
        if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
          if (!s->closed) {
            s->closed = 1;
            closed_count++;
            epoll_ctl(ep, EPOLL_CTL_DEL, s->fd, NULL);
            close(s->fd);
          }
        }
        break;
      }
    }
  }
}
