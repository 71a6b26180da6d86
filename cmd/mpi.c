/* MPI for the commands (the MPI build, build/mpi/kvcal, compiled with
 * -DKV_MPI): start and stop MPI when a launcher started the process, the
 * rank and size, every rank's agreement on a status, and a file's bytes
 * sent to rank 0. Without KV_MPI, one process of one rank. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <signal.h>
#include <stdint.h>
#include <unistd.h>

#include "cli.h"

#ifdef KV_MPI
#include <mpi.h>

static int mpi_on, mpi_rank, mpi_size = 1;

/* Every rank's host (a hash of its name) and process id, for telling
 * which ranks on this host have died (cli_mpi_dead_ranks). */
struct peer {
    uint64_t host;
    int64_t pid;
};
static struct peer *peers;

static uint64_t host_hash(void) {
    char name[256] = "";
    gethostname(name, sizeof name - 1);
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (const char *p = name; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ULL;
    return h;
}

void cli_mpi_init(int *argc, char ***argv) {
    /* only under a launcher: the MPI build run by hand is one plain process */
    if (!getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMIX_RANK") && !getenv("PMI_SIZE")) return;
    if (MPI_Init(argc, argv) != MPI_SUCCESS) return;
    mpi_on = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    struct peer me = {host_hash(), (int64_t)getpid()};
    if (mpi_size > 1 && (peers = calloc((size_t)mpi_size, sizeof *peers)))
        MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, peers, (int)sizeof me, MPI_BYTE, MPI_COMM_WORLD);
}

/* Whether process pid has ended: gone, or a zombie not yet reaped. */
static int pid_ended(int64_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f) return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close_paren = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

int cli_mpi_dead_ranks(char *list, size_t cap, int *speak) {
    int n = 0, lower_alive = 0;
    uint64_t here = host_hash();
    if (cap) list[0] = 0;
    for (int r = 0; peers && r < mpi_size; r++) {
        if (r == mpi_rank) continue;
        int dead = peers[r].host == here && pid_ended(peers[r].pid);
        if (!dead && r < mpi_rank) lower_alive = 1;
        if (!dead) continue;
        size_t len = strlen(list);
        if (len + 16 < cap) snprintf(list + len, cap - len, "%s%d", n ? ", " : "", r);
        n++;
    }
    *speak = !lower_alive;
    return n;
}

void cli_mpi_finalize(void) {
    if (mpi_on) MPI_Finalize();
    mpi_on = 0;
    free(peers);
    peers = NULL;
}

int cli_mpi_rank(void) { return mpi_rank; }
int cli_mpi_size(void) { return mpi_size; }

int cli_mpi_any_failed(int failed) {
    if (mpi_size < 2) return failed != 0;
    int mine = failed != 0, any = 0;
    MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return any;
}

/* MPI counts are ints: the arrays go in pieces of at most this many */
#define PIECE ((int64_t)1 << 24)

void cli_mpi_sum(double *v, int64_t n) {
    for (int64_t at = 0; mpi_size > 1 && at < n; at += PIECE) {
        int k = (int)(n - at < PIECE ? n - at : PIECE);
        MPI_Allreduce(MPI_IN_PLACE, v + at, k, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    }
}

void cli_mpi_max(double *v, int64_t n) {
    for (int64_t at = 0; mpi_size > 1 && at < n; at += PIECE) {
        int k = (int)(n - at < PIECE ? n - at : PIECE);
        MPI_Allreduce(MPI_IN_PLACE, v + at, k, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
}

#define CHUNK ((int64_t)1 << 26) /* bytes per message */

/* Rank `from`: send path's size, then its bytes in chunks; -1 for a file
 * that cannot be read. */
static int send_file(const char *path, char *msg, size_t cap) {
    int fd = open(path, O_RDONLY);
    struct stat st;
    int64_t size = fd >= 0 && fstat(fd, &st) == 0 ? (int64_t)st.st_size : -1;
    if (size < 0) snprintf(msg, cap, "%s: cannot read: %s", path, strerror(errno));
    MPI_Send(&size, 1, MPI_INT64_T, 0, 1, MPI_COMM_WORLD);
    char *buf = size > 0 ? malloc((size_t)(size < CHUNK ? size : CHUNK)) : NULL;
    int rc = size < 0;
    for (int64_t at = 0; size > 0 && at < size;) {
        int64_t n = size - at < CHUNK ? size - at : CHUNK;
        /* a read that fails still sends the chunk (its bytes are then
         * garbage) so the receiver is not left waiting; it is reported */
        if (!rc && (!buf || pread(fd, buf, (size_t)n, at) != (ssize_t)n)) {
            snprintf(msg, cap, "%s: cannot read at byte %lld", path, (long long)at);
            rc = 1;
        }
        MPI_Send(buf ? buf : (char *)&size, buf ? (int)n : 0, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
        at += n;
    }
    free(buf);
    if (fd >= 0) close(fd);
    return rc;
}

/* Rank 0: receive rank from's file into path (created). */
static int recv_file(int from, const char *path, char *msg, size_t cap) {
    int64_t size = -1;
    MPI_Recv(&size, 1, MPI_INT64_T, from, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (size < 0) {
        snprintf(msg, cap, "rank %d of %d could not read its statistics", from, mpi_size);
        return 1;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    char *buf = size > 0 ? malloc((size_t)(size < CHUNK ? size : CHUNK)) : NULL;
    int rc = fd < 0;
    if (rc) snprintf(msg, cap, "%s: cannot create: %s", path, strerror(errno));
    for (int64_t at = 0; size > 0 && at < size;) {
        int64_t n = size - at < CHUNK ? size - at : CHUNK;
        int got = 0;
        MPI_Status stt;
        MPI_Recv(buf ? buf : (char *)&size, buf ? (int)n : 0, MPI_BYTE, from, 2, MPI_COMM_WORLD, &stt);
        MPI_Get_count(&stt, MPI_BYTE, &got);
        if (!rc && (!buf || got != n || pwrite(fd, buf, (size_t)n, at) != (ssize_t)n)) {
            snprintf(msg, cap, "%s: cannot write at byte %lld: %s", path, (long long)at,
                     !buf || got != n ? "short message" : strerror(errno));
            rc = 1;
        }
        at += n;
    }
    if (!rc && fsync(fd) != 0) {
        snprintf(msg, cap, "%s: cannot sync: %s", path, strerror(errno));
        rc = 1;
    }
    free(buf);
    if (fd >= 0) close(fd);
    return rc;
}

int cli_mpi_file_to_root(int from, const char *src, const char *dst, char *msg, size_t cap) {
    if (mpi_size < 2 || from == 0) return 0;
    if (mpi_rank == from) return send_file(src, msg, cap);
    if (mpi_rank == 0) return recv_file(from, dst, msg, cap);
    return 0;
}

#else

void cli_mpi_init(int *argc, char ***argv) {
    (void)argc, (void)argv;
}
void cli_mpi_finalize(void) {}
int cli_mpi_rank(void) { return 0; }
int cli_mpi_size(void) { return 1; }
int cli_mpi_any_failed(int failed) { return failed != 0; }
int cli_mpi_dead_ranks(char *list, size_t cap, int *speak) {
    if (cap) list[0] = 0;
    *speak = 1;
    return 0;
}
void cli_mpi_sum(double *v, int64_t n) {
    (void)v, (void)n;
}
void cli_mpi_max(double *v, int64_t n) {
    (void)v, (void)n;
}
int cli_mpi_file_to_root(int from, const char *src, const char *dst, char *msg, size_t cap) {
    (void)from, (void)src, (void)dst, (void)msg, (void)cap;
    return 0;
}

#endif
