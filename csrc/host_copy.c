/* The copies of a fused CPU allreduce, into its flat buffer and out of it, in one call.
 *
 * torch copies one tensor per dispatch: for hundreds of small gradients its per-tensor
 * cost outweighs the bytes (about 0.8 us a tensor for _foreach_copy_). Here each tensor
 * costs four reads through torch.Tensor's descriptors (bind(), once) and a memcpy, and the
 * memcpys run without the GIL.
 *
 * gather(tensors, address, nbytes): copies the tensors' bytes one after the other to the
 *     buffer at `address`, `nbytes` long.
 * scatter(tensors, address, nbytes): copies consecutive pieces of that buffer into the
 *     tensors.
 *
 * Every tensor must be a contiguous CPU tensor, and together they must fit the buffer;
 * anything else raises ValueError before a byte is copied. The caller keeps the tensors
 * and the buffer alive for the call (it holds them). Built by setup.py when a C compiler
 * is there; baguahvd.kernels.host_copy falls back to torch without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *address;
    Py_ssize_t nbytes;
} Piece;

/* torch.Tensor's own descriptors (bind()): calling them directly skips the attribute
 * lookup and the bound method a tensor.data_ptr() would make, and they refuse any object
 * that is not a tensor. */
static PyObject *data_ptr_method, *is_contiguous_method, *nbytes_getter, *is_cpu_getter;

static PyObject *call_descriptor(PyObject *descriptor, PyObject *tensor, int method) {
    if (descriptor == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
        return NULL;
    }
    if (method) return PyObject_Vectorcall(descriptor, &tensor, 1, NULL);
    return Py_TYPE(descriptor)->tp_descr_get(descriptor, tensor, (PyObject *)Py_TYPE(tensor));
}

/* A descriptor's value for a tensor as a C integer (-1 on error) or truth (-1 on error). */
static int read_long_long(PyObject *tensor, PyObject *descriptor, int method,
                          long long *value) {
    PyObject *result = call_descriptor(descriptor, tensor, method);
    if (result == NULL) return -1;
    *value = PyLong_AsLongLong(result);
    Py_DECREF(result);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int read_truth(PyObject *tensor, PyObject *descriptor, int method) {
    PyObject *result = call_descriptor(descriptor, tensor, method);
    if (result == NULL) return -1;
    int truth = PyObject_IsTrue(result);
    Py_DECREF(result);
    return truth;
}

/* The address and length of each tensor, checked; NULL with an exception set. */
static Piece *pieces_of(PyObject *tensors, Py_ssize_t buffer_nbytes, Py_ssize_t *count) {
    PyObject *sequence = PySequence_Fast(tensors, "tensors must be a sequence");
    if (sequence == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    Piece *pieces = PyMem_Malloc(sizeof(Piece) * (n > 0 ? n : 1));
    if (pieces == NULL) {
        Py_DECREF(sequence);
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *tensor = items[i];
        long long address, nbytes;
        int cpu = read_truth(tensor, is_cpu_getter, 0);
        if (cpu < 0) goto fail;
        if (!cpu) {
            PyErr_Format(PyExc_ValueError, "tensor %zd is not a CPU tensor", i);
            goto fail;
        }
        int contiguous = read_truth(tensor, is_contiguous_method, 1);
        if (contiguous < 0) goto fail;
        if (!contiguous) {
            PyErr_Format(PyExc_ValueError, "tensor %zd is not contiguous", i);
            goto fail;
        }
        if (read_long_long(tensor, data_ptr_method, 1, &address) < 0) goto fail;
        if (read_long_long(tensor, nbytes_getter, 0, &nbytes) < 0) goto fail;
        if (nbytes < 0 || nbytes > buffer_nbytes - total) {
            PyErr_Format(PyExc_ValueError,
                         "the tensors need more than the buffer's %zd bytes", buffer_nbytes);
            goto fail;
        }
        pieces[i].address = (char *)(uintptr_t)address;
        pieces[i].nbytes = (Py_ssize_t)nbytes;
        total += (Py_ssize_t)nbytes;
    }
    Py_DECREF(sequence);
    *count = n;
    return pieces;
fail:
    Py_DECREF(sequence);
    PyMem_Free(pieces);
    return NULL;
}

static int parse_buffer(PyObject *address_object, Py_ssize_t nbytes, char **address) {
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "the buffer's length must not be negative");
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(address_object);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (value == 0 && nbytes > 0) {
        PyErr_SetString(PyExc_ValueError, "the buffer's address is null");
        return -1;
    }
    *address = (char *)(uintptr_t)value;
    return 0;
}

/* Copies between the tensors and the buffer: into it (gather) or out of it (scatter). */
static PyObject *copy_pieces(PyObject *args, const char *format, int into_buffer) {
    PyObject *tensors, *address_object;
    Py_ssize_t nbytes, count;
    char *buffer;
    if (!PyArg_ParseTuple(args, format, &tensors, &address_object, &nbytes)) return NULL;
    if (parse_buffer(address_object, nbytes, &buffer) < 0) return NULL;
    Piece *pieces = pieces_of(tensors, nbytes, &count);
    if (pieces == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t length = (size_t)pieces[i].nbytes;
        if (length == 0) continue;  /* an empty tensor's address may be null */
        if (into_buffer)
            memcpy(buffer, pieces[i].address, length);
        else
            memcpy(pieces[i].address, buffer, length);
        buffer += length;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(pieces);
    Py_RETURN_NONE;
}

static PyObject *gather(PyObject *self, PyObject *args) {
    (void)self;
    return copy_pieces(args, "OOn:gather", 1);
}

static PyObject *scatter(PyObject *self, PyObject *args) {
    (void)self;
    return copy_pieces(args, "OOn:scatter", 0);
}

static PyObject *bind(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *data_ptr, *is_contiguous, *nbytes, *is_cpu;
    if (!PyArg_ParseTuple(args, "OOOO:bind", &data_ptr, &is_contiguous, &nbytes, &is_cpu))
        return NULL;
    if (!PyCallable_Check(data_ptr) || !PyCallable_Check(is_contiguous)
        || Py_TYPE(nbytes)->tp_descr_get == NULL || Py_TYPE(is_cpu)->tp_descr_get == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "bind(data_ptr, is_contiguous, nbytes, is_cpu) takes torch.Tensor's "
                        "two methods and two properties");
        return NULL;
    }
    Py_INCREF(data_ptr);
    Py_INCREF(is_contiguous);
    Py_INCREF(nbytes);
    Py_INCREF(is_cpu);
    Py_XSETREF(data_ptr_method, data_ptr);
    Py_XSETREF(is_contiguous_method, is_contiguous);
    Py_XSETREF(nbytes_getter, nbytes);
    Py_XSETREF(is_cpu_getter, is_cpu);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(data_ptr, is_contiguous, nbytes, is_cpu): torch.Tensor's descriptors, which the "
     "copies read each tensor through."},
    {"gather", gather, METH_VARARGS,
     "gather(tensors, address, nbytes): the tensors' bytes, one after the other, into the "
     "buffer at address."},
    {"scatter", scatter, METH_VARARGS,
     "scatter(tensors, address, nbytes): consecutive pieces of the buffer at address into "
     "the tensors."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_copy",
    "The copies of a fused CPU allreduce in one call (csrc/host_copy.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__host_copy(void) { return PyModule_Create(&module); }
