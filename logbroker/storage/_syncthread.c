/* The shared flush's thread, in C: a flush round's writes and its syncfs without the GIL.
 *
 * A round of logbroker.storage._flush.SharedFlush writes the bytes its range logs asked for
 * (one write per file) and makes them durable with one syncfs. On a Python thread each blocking
 * call of the round lets go of the GIL and takes it back after, and the round's start and its
 * hand-back to the reactor take it too: with the reactor busy, those waits were a third of a
 * round (docs/decisions/0027-native-flush-thread.md). SyncThread runs the round on a thread that
 * never holds the GIL: start() hands it the file descriptors and their bytes, the thread writes
 * them in order, calls syncfs once and signals an eventfd, which the reactor watches; result()
 * then gives the outcome. One round at a time, as SharedFlush runs them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int event_fd;
    int thread_started;
    int closed;
    /* Under lock: a round handed over and not yet run, a round run and not yet collected, and
     * the request to stop. */
    int pending;
    int finished;
    int stopping;
    /* The round: owned by the thread from start() until it sets finished, then by result(). */
    Py_ssize_t count;
    int *fds;
    Py_buffer *buffers;
    int *write_errors;
    int sync_fd;
    int sync_error;
    double seconds;
} SyncThread;

static double
monotonic_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Each file's bytes in full (a short write goes on where it stopped), then one syncfs. */
static void
run_round(SyncThread *self)
{
    double started = monotonic_seconds();
    for (Py_ssize_t i = 0; i < self->count; i++) {
        const char *data = self->buffers[i].buf;
        Py_ssize_t left = self->buffers[i].len;
        self->write_errors[i] = 0;
        while (left > 0) {
            ssize_t written = write(self->fds[i], data, (size_t)left);
            if (written < 0) {
                if (errno == EINTR) {
                    continue;
                }
                self->write_errors[i] = errno;
                break;
            }
            data += written;
            left -= written;
        }
    }
    self->sync_error = syncfs(self->sync_fd) == 0 ? 0 : errno;
    self->seconds = monotonic_seconds() - started;
}

static void *
thread_main(void *argument)
{
    SyncThread *self = argument;
    for (;;) {
        pthread_mutex_lock(&self->lock);
        while (!self->pending && !self->stopping) {
            pthread_cond_wait(&self->wake, &self->lock);
        }
        if (self->stopping) {
            pthread_mutex_unlock(&self->lock);
            return NULL;
        }
        pthread_mutex_unlock(&self->lock);
        run_round(self);
        pthread_mutex_lock(&self->lock);
        self->pending = 0;
        self->finished = 1;
        pthread_mutex_unlock(&self->lock);
        uint64_t one = 1;
        while (write(self->event_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
        }
    }
}

/* With the GIL: give back what a round held. */
static void
release_round(SyncThread *self)
{
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyBuffer_Release(&self->buffers[i]);
    }
    PyMem_Free(self->fds);
    PyMem_Free(self->buffers);
    PyMem_Free(self->write_errors);
    self->fds = NULL;
    self->buffers = NULL;
    self->write_errors = NULL;
    self->count = 0;
}

static PyObject *
SyncThread_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    SyncThread *self;
    int error;

    if (!PyArg_ParseTuple(args, ":SyncThread") || (kwargs && PyDict_Size(kwargs))) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "SyncThread() takes no arguments");
        }
        return NULL;
    }
    self = (SyncThread *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->event_fd = -1;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->wake, NULL);
    self->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->event_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    error = pthread_create(&self->thread, NULL, thread_main, self);
    if (error != 0) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->thread_started = 1;
    return (PyObject *)self;
}

PyDoc_STRVAR(start_doc,
             "start(writes, sync_fd, /)\n--\n\n"
             "Run a round on the thread: write each (fd, bytes) of the list writes in full, in\n"
             "order, then syncfs(sync_fd). Returns at once; the event descriptor (fileno())\n"
             "becomes readable when the round is over. RuntimeError while a round is under way\n"
             "or not collected, ValueError once closed.");

static PyObject *
SyncThread_start(SyncThread *self, PyObject *args)
{
    PyObject *writes;
    int sync_fd;
    Py_ssize_t count;

    if (!PyArg_ParseTuple(args, "O!i:start", &PyList_Type, &writes, &sync_fd)) {
        return NULL;
    }
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "the sync thread is closed");
        return NULL;
    }
    if (self->fds != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a round is under way or not collected");
        return NULL;
    }
    count = PyList_GET_SIZE(writes);
    self->fds = PyMem_Calloc((size_t)count + 1, sizeof(int));
    self->buffers = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    self->write_errors = PyMem_Calloc((size_t)count + 1, sizeof(int));
    if (self->fds == NULL || self->buffers == NULL || self->write_errors == NULL) {
        release_round(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(writes, i);
        int fd;
        if (!PyArg_ParseTuple(item, "iy*:start", &fd, &self->buffers[i])) {
            release_round(self);
            return NULL;
        }
        self->fds[i] = fd;
        self->count = i + 1;
    }
    self->sync_fd = sync_fd;
    pthread_mutex_lock(&self->lock);
    self->pending = 1;
    pthread_cond_signal(&self->wake);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(result_doc,
             "result(, /)\n--\n\n"
             "The outcome of the round that is over, (write_errors, sync_error, seconds): each\n"
             "write's errno in the order given (0: written in full), syncfs's errno (0: synced)\n"
             "and the seconds the round took; None while none is. Clears the event descriptor.");

static PyObject *
SyncThread_result(SyncThread *self, PyObject *unused)
{
    uint64_t count;
    int finished;
    PyObject *errors;

    (void)unused;
    if (self->closed) {
        Py_RETURN_NONE;
    }
    while (read(self->event_fd, &count, sizeof(count)) < 0 && errno == EINTR) {
    }
    pthread_mutex_lock(&self->lock);
    finished = self->finished;
    self->finished = 0;
    pthread_mutex_unlock(&self->lock);
    if (!finished) {
        Py_RETURN_NONE;
    }
    errors = PyList_New(self->count);
    if (errors == NULL) {
        release_round(self);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyObject *code = PyLong_FromLong(self->write_errors[i]);
        if (code == NULL) {
            Py_DECREF(errors);
            release_round(self);
            return NULL;
        }
        PyList_SET_ITEM(errors, i, code);
    }
    release_round(self);
    return Py_BuildValue("(Nid)", errors, self->sync_error, self->seconds);
}

static PyObject *
SyncThread_fileno(SyncThread *self, PyObject *unused)
{
    (void)unused;
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "the sync thread is closed");
        return NULL;
    }
    return PyLong_FromLong(self->event_fd);
}

/* Stop the thread (after the round it runs, if any) and close the event descriptor. */
static void
close_thread(SyncThread *self)
{
    if (self->closed) {
        return;
    }
    self->closed = 1;
    if (self->thread_started) {
        pthread_mutex_lock(&self->lock);
        self->stopping = 1;
        pthread_cond_signal(&self->wake);
        pthread_mutex_unlock(&self->lock);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(self->thread, NULL);
        Py_END_ALLOW_THREADS
        self->thread_started = 0;
    }
    if (self->fds != NULL) {
        release_round(self);
    }
    if (self->event_fd >= 0) {
        close(self->event_fd);
        self->event_fd = -1;
    }
}

PyDoc_STRVAR(close_doc,
             "close(, /)\n--\n\n"
             "Stop the thread, once the round it runs (if any) is over, and close the event\n"
             "descriptor. A round handed over and not begun is not run.");

static PyObject *
SyncThread_close(SyncThread *self, PyObject *unused)
{
    (void)unused;
    close_thread(self);
    Py_RETURN_NONE;
}

static void
SyncThread_dealloc(SyncThread *self)
{
    close_thread(self);
    pthread_cond_destroy(&self->wake);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef SyncThread_methods[] = {
    {"start", (PyCFunction)SyncThread_start, METH_VARARGS, start_doc},
    {"result", (PyCFunction)SyncThread_result, METH_NOARGS, result_doc},
    {"fileno", (PyCFunction)SyncThread_fileno, METH_NOARGS,
     "fileno(, /)\n--\n\nThe event descriptor: readable once a round is over."},
    {"close", (PyCFunction)SyncThread_close, METH_NOARGS, close_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SyncThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "logbroker.storage._syncthread.SyncThread",
    .tp_doc = "A thread that runs flush rounds (writes, then one syncfs) without the GIL.",
    .tp_basicsize = sizeof(SyncThread),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = SyncThread_new,
    .tp_dealloc = (destructor)SyncThread_dealloc,
    .tp_methods = SyncThread_methods,
};

static struct PyModuleDef syncthread_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "logbroker.storage._syncthread",
    .m_doc = "The shared flush's rounds on a thread of their own, without the GIL.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__syncthread(void)
{
    PyObject *module;
    if (PyType_Ready(&SyncThreadType) < 0) {
        return NULL;
    }
    module = PyModule_Create(&syncthread_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&SyncThreadType);
    if (PyModule_AddObject(module, "SyncThread", (PyObject *)&SyncThreadType) < 0) {
        Py_DECREF(&SyncThreadType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
