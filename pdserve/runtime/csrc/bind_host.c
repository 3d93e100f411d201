/* A bind() interposer, preloaded (LD_PRELOAD) into pdserve's service processes, so that the
 * Mooncake Transfer Engine listens on the configured host and not on every address: it binds its
 * handshake port to INADDR_ANY and its data port to in6addr_any, and has no option to do otherwise.
 *
 * A thread that called pdserve_bind_narrow(host) has each wildcard bind it makes put on `host`
 * instead (an IPv6 socket on the IPv4-mapped form of an IPv4 host), until it calls it again with
 * "". The setting is per thread: the engine binds on the thread that initializes it, and every
 * other bind of the process (gRPC's on its --host, say) is left as it is. A bind to a named
 * address passes through unchanged. An IPv4 wildcard bind on a thread confined to an IPv6 host is
 * refused (EADDRNOTAVAIL): never wider than configured. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static __thread int narrow_family; /* 0: pass through; AF_INET or AF_INET6: the host's family */
static __thread struct in_addr host4;
static __thread struct in6_addr host6; /* the host, or an IPv4 host's IPv4-mapped form */

/* Confine this thread's wildcard binds to `host` (a numeric IPv4 or IPv6 address); "" or NULL
 * ends it. Returns 0, or -1 when `host` is not a numeric address (nothing changes then). */
int pdserve_bind_narrow(const char *host) {
    struct in_addr a4;
    struct in6_addr a6;
    if (host == NULL || host[0] == '\0') {
        narrow_family = 0;
        return 0;
    }
    if (inet_pton(AF_INET, host, &a4) == 1) {
        host4 = a4;
        memset(&host6, 0, sizeof host6);
        host6.s6_addr[10] = 0xff;
        host6.s6_addr[11] = 0xff;
        memcpy(&host6.s6_addr[12], &a4, sizeof a4);
        narrow_family = AF_INET;
        return 0;
    }
    if (inet_pton(AF_INET6, host, &a6) == 1) {
        host6 = a6;
        narrow_family = AF_INET6;
        return 0;
    }
    return -1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (real_bind == NULL)
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (narrow_family && addr != NULL && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in;
        memcpy(&in, addr, sizeof in);
        if (in.sin_addr.s_addr == htonl(INADDR_ANY)) {
            if (narrow_family != AF_INET) {
                errno = EADDRNOTAVAIL;
                return -1;
            }
            in.sin_addr = host4;
            return real_bind(fd, (const struct sockaddr *)&in, sizeof in);
        }
    } else if (narrow_family && addr != NULL && addr->sa_family == AF_INET6 &&
               len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
            in6.sin6_addr = host6;
            return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return real_bind(fd, addr, len);
}
