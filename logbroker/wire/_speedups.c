/* Native record decoder: the client protocol's records into Record objects, the produce path's
 * decoding in C.
 *
 * read_records(record_type, data, position, count) reads `count` records from data[position:]
 * (record = str(key) value_len:u32 value timestamp_ms:u64 header_count:u32 (str str)*, with
 * str = 0x00 for null or 0x01 len:u32 bytes; docs/protocol.md) and returns (records, end): the
 * same records logbroker.wire.primitives.Reader.record reads, one after the other, and where
 * the last one ends. It does not report errors: on anything that is not a valid encoding it
 * returns None, and the caller reads the records again in Python, which raises the protocol's
 * error for exactly what is wrong. The tests hold both readers to the same results.
 *
 * Why C: every produced record is decoded on the client port, and again on its range's primary
 * when it was forwarded there; in Python that was a sixth of a replicating cluster's reactor
 * time (bench/RESULTS.md, replicated_produce.py).
 *
 * The Record objects are made without calling Record(): the decoded fields are of the exact
 * types and sizes Record's own checks demand (bytes shorter than the null length, a u64
 * timestamp, a tuple of pairs), so they are set directly on a new instance, bypassing the
 * frozen class's __setattr__ as object.__setattr__ would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define NULL_LENGTH 0xFFFFFFFFu

static PyObject *str_key, *str_value, *str_timestamp_ms, *str_headers;

static inline uint32_t
get_u32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t
get_u64(const uint8_t *p)
{
    return ((uint64_t)get_u32(p) << 32) | get_u32(p + 4);
}

/* What reading a field found. */
enum { READ_OK = 0, READ_INVALID = -1, READ_ERROR = -2 };

/* Reads `length` bytes at *position into a new bytes object. */
static int
read_bytes(const uint8_t *data, size_t size, size_t *position, uint32_t length, PyObject **out)
{
    if (length == NULL_LENGTH || length > size - *position) {
        return READ_INVALID;
    }
    *out = PyBytes_FromStringAndSize((const char *)data + *position, (Py_ssize_t)length);
    if (*out == NULL) {
        return READ_ERROR;
    }
    *position += length;
    return READ_OK;
}

/* Reads a nullable string at *position: None or a new bytes object. */
static int
read_str(const uint8_t *data, size_t size, size_t *position, PyObject **out)
{
    uint8_t marker;
    if (*position >= size) {
        return READ_INVALID;
    }
    marker = data[*position];
    if (marker == 0x00) {
        *position += 1;
        *out = Py_NewRef(Py_None);
        return READ_OK;
    }
    if (marker != 0x01 || size - *position < 5) {
        return READ_INVALID;
    }
    *position += 5;
    return read_bytes(data, size, position, get_u32(data + *position - 4), out);
}

static int
read_headers(const uint8_t *data, size_t size, size_t *position, uint32_t count, PyObject **out)
{
    PyObject *headers;
    /* Every header takes at least two bytes (two null strings). */
    if ((uint64_t)count * 2 > size - *position) {
        return READ_INVALID;
    }
    headers = PyTuple_New((Py_ssize_t)count);
    if (headers == NULL) {
        return READ_ERROR;
    }
    for (uint32_t i = 0; i < count; i++) {
        PyObject *name = NULL, *value = NULL, *pair;
        int found = read_str(data, size, position, &name);
        if (found == READ_OK) {
            found = read_str(data, size, position, &value);
        }
        if (found != READ_OK) {
            Py_XDECREF(name);
            Py_DECREF(headers);
            return found;
        }
        pair = PyTuple_Pack(2, name, value);
        Py_DECREF(name);
        Py_DECREF(value);
        if (pair == NULL) {
            Py_DECREF(headers);
            return READ_ERROR;
        }
        PyTuple_SET_ITEM(headers, i, pair);
    }
    *out = headers;
    return READ_OK;
}

/* Reads one record at *position into a new Record. */
static int
read_record(PyTypeObject *type, const uint8_t *data, size_t size, size_t *position,
            PyObject **out)
{
    PyObject *key = NULL, *value = NULL, *timestamp, *headers = NULL, *record;
    uint32_t count;
    int found = read_str(data, size, position, &key);
    if (found != READ_OK) {
        return found;
    }
    if (size - *position < 4) {
        Py_DECREF(key);
        return READ_INVALID;
    }
    *position += 4;
    found = read_bytes(data, size, position, get_u32(data + *position - 4), &value);
    if (found != READ_OK) {
        Py_DECREF(key);
        return found;
    }
    if (size - *position < 12) {
        Py_DECREF(key);
        Py_DECREF(value);
        return READ_INVALID;
    }
    timestamp = PyLong_FromUnsignedLongLong(get_u64(data + *position));
    count = get_u32(data + *position + 8);
    *position += 12;
    found = timestamp == NULL ? READ_ERROR : read_headers(data, size, position, count, &headers);
    if (found != READ_OK) {
        Py_DECREF(key);
        Py_DECREF(value);
        Py_XDECREF(timestamp);
        return found;
    }
    record = type->tp_alloc(type, 0);
    if (record == NULL) {
        Py_DECREF(key);
        Py_DECREF(value);
        Py_DECREF(timestamp);
        Py_DECREF(headers);
        return READ_ERROR;
    }
    {
        PyObject *fields[4][2] = {
            {str_value, value}, {str_key, key}, {str_timestamp_ms, timestamp}, {str_headers, headers}};
        int failed = 0;
        for (int i = 0; i < 4; i++) {
            /* Set on the slot itself, as object.__setattr__ does: the class is frozen. */
            if (!failed && PyObject_GenericSetAttr(record, fields[i][0], fields[i][1]) < 0) {
                failed = 1;
            }
            Py_DECREF(fields[i][1]);
        }
        if (failed) {
            Py_DECREF(record);
            return READ_ERROR;
        }
    }
    *out = record;
    return READ_OK;
}

PyDoc_STRVAR(read_records_doc,
             "read_records(record_type, data, position, count, /)\n--\n\n"
             "The count client protocol records in data from position, as record_type objects,\n"
             "and where they end: (records, end); None if they are not a valid encoding.");

static PyObject *
read_records(PyObject *module, PyObject *args)
{
    PyObject *type_object, *records = NULL, *result = NULL;
    Py_buffer data;
    Py_ssize_t start, count;
    size_t position;

    (void)module;
    if (!PyArg_ParseTuple(args, "O!y*nn:read_records", &PyType_Type, &type_object, &data, &start,
                          &count)) {
        return NULL;
    }
    if (start < 0 || start > data.len || count < 0) {
        PyErr_SetString(PyExc_ValueError, "read_records: position and count out of range");
        goto done;
    }
    /* A record takes at least 17 bytes (null key, value length, timestamp, header count). */
    if ((uint64_t)count * 17 > (uint64_t)(data.len - start)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    records = PyTuple_New(count);
    if (records == NULL) {
        goto done;
    }
    position = (size_t)start;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *record = NULL;
        int found = read_record((PyTypeObject *)type_object, (const uint8_t *)data.buf,
                               (size_t)data.len, &position, &record);
        if (found == READ_INVALID) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (found == READ_ERROR) {
            goto done;
        }
        PyTuple_SET_ITEM(records, i, record);
    }
    result = Py_BuildValue("(On)", records, (Py_ssize_t)position);
done:
    Py_XDECREF(records);
    PyBuffer_Release(&data);
    return result;
}

/* -- checking a produce's records without decoding them ------------------------------------
 *
 * scan_wire_records checks the records a produce (or a forwarded share) carries where they
 * enter, so that they can go on as the bytes they came in (logbroker.records.WireRecords,
 * docs/decisions/0022-a-produce-stays-in-its-wire-bytes.md). None for anything that is not
 * `count` valid records: the caller reads them again in Python, which names what is wrong.
 */

#include "_wire_record.h"

PyDoc_STRVAR(scan_wire_records_doc,
             "scan_wire_records(data, position, count, /)\n--\n\n"
             "(end, key and value bytes) of the count client protocol records from\n"
             "data[position:], or None if they are not count valid records.");

static PyObject *
scan_wire_records(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t start, count;
    size_t position;
    uint64_t size = 0;
    WireRecord record;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*nn:scan_wire_records", &data, &start, &count)) {
        return NULL;
    }
    if (start < 0 || start > data.len || count < 0) {
        PyErr_SetString(PyExc_ValueError, "scan_wire_records: position must lie in data");
        goto done;
    }
    position = (size_t)start;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (parse_wire_record(data.buf, (size_t)data.len, &position, &record) < 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        size += record.value_length + (record.key == NULL ? 0 : record.key_length);
    }
    result = Py_BuildValue("(nK)", (Py_ssize_t)position, (unsigned long long)size);
done:
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef speedups_methods[] = {
    {"read_records", (PyCFunction)read_records, METH_VARARGS, read_records_doc},
    {"scan_wire_records", (PyCFunction)scan_wire_records, METH_VARARGS, scan_wire_records_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "logbroker.wire._speedups",
    .m_doc = "Native record decoder for logbroker's client protocol (see primitives.py).",
    .m_size = -1,
    .m_methods = speedups_methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    str_key = PyUnicode_InternFromString("key");
    str_value = PyUnicode_InternFromString("value");
    str_timestamp_ms = PyUnicode_InternFromString("timestamp_ms");
    str_headers = PyUnicode_InternFromString("headers");
    if (!str_key || !str_value || !str_timestamp_ms || !str_headers) {
        return NULL;
    }
    return PyModule_Create(&speedups_module);
}
