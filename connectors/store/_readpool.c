/* Helper threads that read a file's back part while the caller hashes (read_ahead.py).

   A job is the back part of one open file, [begin, end), split into steps. Each step is
   read with pread() by whichever thread claims it first: the job's helper, in order
   from the start of the part, or the caller (Job.__next__), which takes each step in
   order once its bytes are in, reads any step the helper has not started, and while the
   helper reads one, reads the last step nobody has claimed (the two meet in the middle,
   so a helper whose CPU is busy costs the load at most the step it is reading).

   Why C: the helpers never hold the GIL. A Python helper thread needs it between its
   reads and to wake up, so it waits on the caller's hashing and on the interpreter's
   switch interval. In the load benchmark, a 2.75 / 10 MB first load into staging on two
   threads measured 0.74 / 0.78x a readinto with Python helpers and 0.87 / 0.84x with
   these; while another Python thread holds the GIL half the time, 0.36 / 0.36x against
   0.58 / 0.55x (performance.md section 1).

   Memory: the caller's buffer is held (a Py_buffer) until Job.close(), which claims every
   step nobody has and waits for the one a helper is reading, so no helper writes into the
   buffer or reads the descriptor after close() returns. A helper may still be looping
   over a closed job's claimed steps, so the job's state is reference-counted: the Job
   object and the helper's queue each hold one reference.

   A job can also hash (start(..., hash=True)): each step, once read, is hashed with
   XXH3-128 by the thread that read it, while its bytes are still in that CPU's cache,
   and Job.digests() gives the steps' digests in order: the pieces of an entry's
   piecewise checksum (entry.py, xxh3_128x512k: a step per piece) that lie in the job's
   part of the file. The read and the hash both split between two threads, where one
   hash over the whole entry is one thread's work. A job with no descriptor (fd -1)
   only hashes: its bytes are in the buffer already (an entry's mapping, whose pages
   the hash faults in on both threads). (xxHash v0.8.2 is vendored, BSD-2: vendor/.)

   Helpers are a process-wide pool of at most set_helpers(n) threads, made on demand;
   start() returns None when none is free (the caller reads alone). After fork() the
   child has no helpers (its pool starts empty). */

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
/* XXH3 with the widest vector unit the CPU has (SSE2, AVX2, AVX-512), chosen at run time
   (vendor/xxh_x86dispatch.c): compiled for SSE2 alone, it hashed 512 KiB in ~80 us
   here, against ~15 us for python-xxhash's AVX-512 */
#include "vendor/xxh_x86dispatch.h"
#else
#define XXH_INLINE_ALL  /* (other CPUs: xxhash.h's compile-time choice, NEON on ARM) */
#include "vendor/xxhash.h"
#endif

enum { FREE = 0, HELPER = 1, CALLER = 2 };       /* who claimed a step */
enum { PENDING = 0, LANDED = 1, FAILED = 2 };    /* a helper step's outcome */

typedef struct state {
    atomic_int refs;
    int fd;
    char *buf;
    Py_ssize_t begin, end, chunk;
    Py_ssize_t nsteps;
    atomic_int *claims;
    atomic_int *outcome;     /* of the steps a helper claimed */
    int hash;                /* hash each step once read (into digests) */
    unsigned char *digests;  /* 16 bytes per step: its XXH3-128, canonical (big-endian) */
    atomic_int stop;
    atomic_uint landed_seq;  /* bumped at each helper step's end: the caller's futex */
    atomic_int waiting;      /* the caller sleeps on landed_seq */
    int err;                 /* a failed helper step: errno, or 0 when the file ended */
    Py_ssize_t eof_at;       /* ... at this offset */
    struct state *next;      /* in a helper's queue */
} state;

typedef struct helper {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    state *head, *tail;
    struct helper *next_free;
} helper;

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static helper *free_helpers;
static int made_helpers, max_helpers;
/* tests only: a helper sleeps this long before each job / each step it reads */
static atomic_long delay_job_ns, delay_step_ns;
/* jobs the helpers ran, steps they read (tests, benchmarks) */
static atomic_long jobs_run, steps_read;

static void sleep_ns(long ns) {
    if (ns > 0) {
        struct timespec t = {ns / 1000000000L, ns % 1000000000L};
        while (nanosleep(&t, &t) && errno == EINTR) {}
    }
}

static void unref(state *s) {
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        free(s->claims);
        free(s->outcome);
        free(s->digests);
        free(s);
    }
}

static Py_ssize_t step_start(const state *s, Py_ssize_t i) {
    return s->begin + i * s->chunk;
}
static Py_ssize_t step_end(const state *s, Py_ssize_t i) {
    Py_ssize_t e = step_start(s, i) + s->chunk;
    return e < s->end ? e : s->end;
}

/* Read step i whole (and hash it, for a hashing job): 0; the errno of a failed read; or
   READ_EOF when the file ended (at *eof_at). */
enum { READ_EOF = -1 };
static int read_step(const state *s, Py_ssize_t i, Py_ssize_t *eof_at) {
    Py_ssize_t off = step_start(s, i), e = step_end(s, i);
    while (s->fd >= 0 && off < e) {  /* (no descriptor: the bytes are in buf, hash only) */
        ssize_t n = pread(s->fd, s->buf + off, (size_t)(e - off), off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) {
            *eof_at = off;
            return READ_EOF;
        }
        off += n;
    }
    if (s->hash) {  /* the digest in canonical form (big-endian), as python-xxhash's */
        XXH128_hash_t h = XXH3_128bits(s->buf + step_start(s, i),
                                       (size_t)(e - step_start(s, i)));
        unsigned char *d = s->digests + 16 * i;
        for (int k = 7; k >= 0; k--) {
            d[k] = (unsigned char)h.high64;
            d[8 + k] = (unsigned char)h.low64;
            h.high64 >>= 8;
            h.low64 >>= 8;
        }
    }
    return 0;
}

static void run(state *s) {
    sleep_ns(atomic_load(&delay_job_ns));
    for (Py_ssize_t i = 0; i < s->nsteps && !atomic_load(&s->stop); i++) {
        int expect = FREE;
        if (!atomic_compare_exchange_strong(&s->claims[i], &expect, HELPER))
            continue;  /* the caller reads it */
        sleep_ns(atomic_load(&delay_step_ns));
        Py_ssize_t eof_at = 0;
        int rc = read_step(s, i, &eof_at), failed = rc != 0;
        if (failed) {
            s->err = rc == READ_EOF ? 0 : rc;
            s->eof_at = eof_at;
            atomic_store(&s->stop, 1);
        }
        if (!failed) atomic_fetch_add(&steps_read, 1);
        atomic_store(&s->outcome[i], failed ? FAILED : LANDED);
        atomic_fetch_add(&s->landed_seq, 1);
        if (atomic_load(&s->waiting))
            syscall(SYS_futex, &s->landed_seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
}

static void *helper_loop(void *arg) {
    helper *h = arg;
    pthread_setname_np(pthread_self(), "encache-read");  /* (as top and py-spy show it) */
    for (;;) {
        pthread_mutex_lock(&h->mu);
        while (h->head == NULL)
            pthread_cond_wait(&h->cv, &h->mu);
        state *s = h->head;
        h->head = s->next;
        if (h->head == NULL) h->tail = NULL;
        pthread_mutex_unlock(&h->mu);
        run(s);
        atomic_fetch_add(&jobs_run, 1);
        unref(s);
    }
    return NULL;
}

static helper *take_helper(void) {
    pthread_mutex_lock(&pool_mu);
    helper *h = free_helpers;
    if (h != NULL) {
        free_helpers = h->next_free;
    } else if (made_helpers < max_helpers) {
        h = calloc(1, sizeof *h);
        if (h != NULL) {
            pthread_mutex_init(&h->mu, NULL);
            pthread_cond_init(&h->cv, NULL);
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            /* the helper blocks every signal (it inherits this mask): signals go to the
               interpreter's threads, whose handlers expect them */
            sigset_t all, old;
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old);
            pthread_t t;
            if (pthread_create(&t, &attr, helper_loop, h) == 0) {
                made_helpers++;
            } else {
                free(h);
                h = NULL;
            }
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            pthread_attr_destroy(&attr);
        }
    }
    pthread_mutex_unlock(&pool_mu);
    return h;
}

static void free_helper(helper *h) {
    pthread_mutex_lock(&pool_mu);
    h->next_free = free_helpers;
    free_helpers = h;
    pthread_mutex_unlock(&pool_mu);
}

static void give(helper *h, state *s) {
    atomic_fetch_add(&s->refs, 1);
    s->next = NULL;
    pthread_mutex_lock(&h->mu);
    if (h->tail) h->tail->next = s; else h->head = s;
    h->tail = s;
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

static void after_fork_child(void) {
    atomic_store(&jobs_run, 0);
    atomic_store(&steps_read, 0);
    /* the child has none of the parent's threads: an empty pool (the parent's helper
       structs are not reused; their queues may hold the parent's jobs) */
    pthread_mutex_init(&pool_mu, NULL);
    free_helpers = NULL;
    made_helpers = 0;
}

/* -- the Job object ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    state *s;
    helper *h;        /* given back to the pool by close() */
    Py_buffer view;   /* held until close() */
    char *settled;    /* the caller is done with step i (its bytes are in, or never read) */
    Py_ssize_t pos;   /* the next step __next__ yields */
    Py_ssize_t last;  /* steps after this one are claimed by someone */
    int closed;
} Job;

static void wait_landed(state *s, Py_ssize_t i) {
    /* (without the GIL) until helper step i ended */
    for (;;) {
        unsigned seq = atomic_load(&s->landed_seq);
        if (atomic_load(&s->outcome[i]) != PENDING) return;
        atomic_store(&s->waiting, 1);
        if (atomic_load(&s->outcome[i]) != PENDING) return;
        syscall(SYS_futex, &s->landed_seq, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);
    }
}

static PyObject *raise_read_error(int err, Py_ssize_t eof_at) {
    if (err == 0) {
        PyObject *arg = PyLong_FromSsize_t(eof_at);
        if (arg) {
            PyErr_SetObject(PyExc_EOFError, arg);
            Py_DECREF(arg);
        }
        return NULL;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *job_next(Job *self) {
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "the job is closed");
        return NULL;
    }
    state *s = self->s;
    Py_ssize_t i = self->pos;
    if (i >= s->nsteps) return NULL;  /* StopIteration */
    while (!self->settled[i]) {
        int expect = FREE;
        Py_ssize_t take = -1;
        if (atomic_compare_exchange_strong(&s->claims[i], &expect, CALLER)) {
            take = i;
        } else if (self->last > i) {
            expect = FREE;
            if (atomic_compare_exchange_strong(&s->claims[self->last], &expect, CALLER))
                take = self->last;  /* the helper reads step i: take one from the end */
            self->last--;  /* (taken, or the helper has it) */
        }
        if (take >= 0) {
            self->settled[take] = 1;
            int rc;
            Py_ssize_t eof_at = 0;
            Py_BEGIN_ALLOW_THREADS
            rc = read_step(s, take, &eof_at);
            Py_END_ALLOW_THREADS
            if (rc) return raise_read_error(rc == READ_EOF ? 0 : rc, eof_at);
        } else if (self->last <= i) {  /* (every later step is claimed) */
            Py_BEGIN_ALLOW_THREADS
            wait_landed(s, i);
            Py_END_ALLOW_THREADS
            self->settled[i] = 1;
            if (atomic_load(&s->outcome[i]) != LANDED)
                return raise_read_error(s->err, s->eof_at);
        }
    }
    self->pos = i + 1;
    return Py_BuildValue("(nn)", step_start(s, i), step_end(s, i));
}

static void job_end(Job *self) {
    /* claim every step nobody has, wait for the ones a helper is reading */
    if (self->closed) return;
    self->closed = 1;
    state *s = self->s;
    atomic_store(&s->stop, 1);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < s->nsteps; i++) {
        if (self->settled[i]) continue;
        int expect = FREE;
        if (!atomic_compare_exchange_strong(&s->claims[i], &expect, CALLER)
                && expect == HELPER)
            wait_landed(s, i);
        self->settled[i] = 1;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&self->view);
    if (self->h) {
        free_helper(self->h);
        self->h = NULL;
    }
}

static PyObject *job_close(Job *self, PyObject *unused) {
    job_end(self);
    Py_RETURN_NONE;
}

static PyObject *job_digests(Job *self, PyObject *unused) {
    if (!self->s->hash) {
        PyErr_SetString(PyExc_ValueError, "the job does not hash");
        return NULL;
    }
    if (self->closed || self->pos < self->s->nsteps) {
        PyErr_SetString(PyExc_ValueError, "the job's steps are not all in");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)self->s->digests, 16 * self->s->nsteps);
}

static PyObject *job_landed(Job *self, PyObject *unused) {
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *job_iter(PyObject *self) {
    Py_INCREF(self);
    return self;
}

static PyObject *job_begin(Job *self, void *closure) {
    return PyLong_FromSsize_t(self->s->begin);
}

static void job_dealloc(Job *self) {
    if (self->s) {
        job_end(self);  /* (a job never closed: end it before its buffer goes) */
        unref(self->s);
    }
    free(self->settled);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef job_methods[] = {
    {"close", (PyCFunction)job_close, METH_NOARGS,
     "End the job: after this no helper touches its descriptor or buffer. Idempotent."},
    {"digests", (PyCFunction)job_digests, METH_NOARGS,
     "A hashing job's steps' XXH3-128 digests (16 bytes each, in order), once every step "
     "was yielded and before close()."},
    {"landed", (PyCFunction)job_landed, METH_NOARGS,
     "Each step's (start, end) once its bytes are in, in file order (the job itself)."},
    {NULL},
};

static PyGetSetDef job_getset[] = {
    {"begin", (getter)job_begin, NULL, "where the job's part of the file starts", NULL},
    {NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "encache.connectors.store._readpool.Job",
    .tp_basicsize = sizeof(Job),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The back part of a file, read in steps by a helper thread and the caller.",
    .tp_dealloc = (destructor)job_dealloc,
    .tp_iter = job_iter,
    .tp_iternext = (iternextfunc)job_next,
    .tp_methods = job_methods,
    .tp_getset = job_getset,
};

/* -- module functions ---------------------------------------------------------------- */

static PyObject *start(PyObject *mod, PyObject *args) {
    int fd, hash = 0;
    PyObject *buf;
    Py_ssize_t begin, end, chunk;
    if (!PyArg_ParseTuple(args, "iOnnn|p", &fd, &buf, &begin, &end, &chunk, &hash))
        return NULL;
    if (chunk <= 0 || begin < 0 || begin > end) {
        PyErr_SetString(PyExc_ValueError, "bad part or step");
        return NULL;
    }
    if (fd < 0 && !hash) {
        PyErr_SetString(PyExc_ValueError, "no descriptor to read and nothing to hash");
        return NULL;
    }
    Job *job = PyObject_New(Job, &JobType);
    if (job == NULL) return NULL;
    job->s = NULL;
    job->h = NULL;
    job->settled = NULL;
    job->closed = 1;  /* (nothing to end until set up) */
    /* (a job that only hashes, fd < 0, reads buf: a read-only mapping will do) */
    if (PyObject_GetBuffer(buf, &job->view, fd < 0 ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) {
        Py_DECREF(job);
        return NULL;
    }
    if (job->view.len < end) {
        PyBuffer_Release(&job->view);
        Py_DECREF(job);
        PyErr_SetString(PyExc_ValueError, "the buffer is shorter than the part");
        return NULL;
    }
    helper *h = take_helper();
    if (h == NULL) {
        PyBuffer_Release(&job->view);
        Py_DECREF(job);
        Py_RETURN_NONE;
    }
    Py_ssize_t nsteps = (end - begin + chunk - 1) / chunk;
    state *s = calloc(1, sizeof *s);
    job->settled = calloc(nsteps ? nsteps : 1, 1);
    if (s) {
        s->claims = calloc(nsteps ? nsteps : 1, sizeof(atomic_int));
        s->outcome = calloc(nsteps ? nsteps : 1, sizeof(atomic_int));
        s->digests = hash ? malloc(16 * (nsteps ? nsteps : 1)) : NULL;
    }
    if (!s || !s->claims || !s->outcome || !job->settled || (hash && !s->digests)) {
        if (s) { free(s->claims); free(s->outcome); free(s->digests); free(s); }
        free_helper(h);
        PyBuffer_Release(&job->view);
        Py_DECREF(job);
        return PyErr_NoMemory();
    }
    atomic_store(&s->refs, 1);
    s->fd = fd;
    s->buf = job->view.buf;
    s->begin = begin;
    s->end = end;
    s->chunk = chunk;
    s->nsteps = nsteps;
    s->hash = hash;
    job->s = s;
    job->h = h;
    job->pos = 0;
    job->last = nsteps - 1;
    job->closed = 0;
    give(h, s);
    return (PyObject *)job;
}

static PyObject *set_helpers(PyObject *mod, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&pool_mu);
    max_helpers = n < 0 ? 0 : (int)n;
    pthread_mutex_unlock(&pool_mu);
    Py_RETURN_NONE;
}

static PyObject *busy_helpers(PyObject *mod, PyObject *unused) {
    pthread_mutex_lock(&pool_mu);
    int n = made_helpers;
    for (helper *h = free_helpers; h; h = h->next_free) n--;
    pthread_mutex_unlock(&pool_mu);
    return PyLong_FromLong(n);
}

static PyObject *counts(PyObject *mod, PyObject *unused) {
    return Py_BuildValue("(ll)", atomic_load(&jobs_run), atomic_load(&steps_read));
}

static PyObject *delay_helpers(PyObject *mod, PyObject *args) {
    double job_s, step_s;
    if (!PyArg_ParseTuple(args, "dd", &job_s, &step_s)) return NULL;
    atomic_store(&delay_job_ns, (long)(job_s * 1e9));
    atomic_store(&delay_step_ns, (long)(step_s * 1e9));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"start", start, METH_VARARGS,
     "start(fd, buf, begin, end, chunk, hash=False) -> Job | None: read [begin, end) of "
     "fd into buf on a helper thread in chunk steps (hash: and hash each step; fd -1: "
     "the bytes are in buf already, only hash them); None when no helper is free."},
    {"set_helpers", set_helpers, METH_O, "set_helpers(n): at most n helper threads."},
    {"busy_helpers", busy_helpers, METH_NOARGS, "helpers given to a job not closed yet."},
    {"counts", counts, METH_NOARGS,
     "(jobs the helpers ran, steps they read) in this process (tests, benchmarks)."},
    {"delay_helpers", delay_helpers, METH_VARARGS,
     "delay_helpers(job_s, step_s): tests only: a helper sleeps before each job / step."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_readpool",
    "Helper threads that read a file's back part without the GIL (read_ahead.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__readpool(void) {
    if (PyType_Ready(&JobType) < 0) return NULL;
    static int at_fork;
    if (!at_fork) {
        pthread_atfork(NULL, NULL, after_fork_child);
        at_fork = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "Job", (PyObject *)&JobType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
