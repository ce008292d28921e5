/* Native batch encoder: the storage engine's produce hot path in C, and the other per-record
 * loops of the hot paths (wire_records for consumers, check_records for replicas, scan_sealed
 * for the sidecars written when a segment seals).
 *
 * encode_batch(base_offset, records) returns exactly the bytes that
 * logbroker.storage._format.encode_batch_python returns for the same arguments: the layout is
 * documented there and in docs/storage-format.md, pinned by the golden-file tests, and the two
 * encoders are held equal by property tests over arbitrary records. Only the framing and the
 * CRC32C move to C; records are validated by logbroker.storage.Record before they get here, and
 * this module checks again only what it needs to stay memory-safe and to refuse what the format
 * cannot hold.
 *
 * Why C: in Python each record costs a struct call, a join and a CRC32C call on the reactor
 * thread, which caps a range at about 2 M records/s, below what the disk takes at batch 1000
 * (docs/decisions/0002-native-batch-encoder.md). The Python encoder stays as the fallback.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define LOGBROKER_HAVE_SSE42 1
#endif

#define FORMAT_VERSION 1
#define BATCH_HEADER_SIZE 24
/* The record header (28 bytes) plus the key and value lengths. */
#define RECORD_FIXED_SIZE 36
#define NULL_LENGTH 0xFFFFFFFFu
#define MAX_FRAME_SIZE 0xFFFFFFFFull
/* CRC32C (Castagnoli), reflected polynomial. */
#define CRC32C_POLY 0x82F63B78u

typedef uint32_t (*crc32c_fn)(uint32_t crc, const uint8_t *data, size_t size);

static uint32_t crc32c_table[256];
static crc32c_fn crc32c_extend;
static const char *crc32c_implementation;

/* Both implementations follow the crc32c package's convention: crc32c(b, crc32c(a)) equals
 * crc32c(a + b), with 0 as the start value. */
static uint32_t
crc32c_software(uint32_t crc, const uint8_t *data, size_t size)
{
    crc = ~crc;
    while (size--) {
        crc = crc32c_table[(crc ^ *data++) & 0xFF] ^ (crc >> 8);
    }
    return ~crc;
}

#ifdef LOGBROKER_HAVE_SSE42
__attribute__((target("sse4.2"))) static uint32_t
crc32c_sse42(uint32_t crc, const uint8_t *data, size_t size)
{
    uint64_t state = (uint32_t)~crc;
    uint32_t tail;
    while (size >= 8) {
        uint64_t word;
        memcpy(&word, data, 8);
        state = _mm_crc32_u64(state, word);
        data += 8;
        size -= 8;
    }
    tail = (uint32_t)state;
    while (size--) {
        tail = _mm_crc32_u8(tail, *data++);
    }
    return ~tail;
}
#endif

static void
crc32c_init(void)
{
    for (uint32_t byte = 0; byte < 256; byte++) {
        uint32_t crc = byte;
        for (int bit = 0; bit < 8; bit++) {
            crc = (crc >> 1) ^ (CRC32C_POLY & (0u - (crc & 1u)));
        }
        crc32c_table[byte] = crc;
    }
    crc32c_extend = crc32c_software;
    crc32c_implementation = "software";
#ifdef LOGBROKER_HAVE_SSE42
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc32c_extend = crc32c_sse42;
        crc32c_implementation = "sse4.2";
    }
#endif
}

static inline uint8_t *
put_u32(uint8_t *out, uint32_t value)
{
    out[0] = (uint8_t)(value >> 24);
    out[1] = (uint8_t)(value >> 16);
    out[2] = (uint8_t)(value >> 8);
    out[3] = (uint8_t)value;
    return out + 4;
}

static inline uint8_t *
put_u64(uint8_t *out, uint64_t value)
{
    out = put_u32(out, (uint32_t)(value >> 32));
    return put_u32(out, (uint32_t)value);
}

/* The fields every frame starts with after its checksum (written last, over the whole frame):
 * magic "L" + kind, version, flags, length, then the offset of its (first) record. */
static uint8_t *
put_frame_head(uint8_t *frame, char kind, uint32_t length, uint64_t offset)
{
    uint8_t *out = frame + 4;
    *out++ = 'L';
    *out++ = (uint8_t)kind;
    *out++ = FORMAT_VERSION;
    *out++ = 0;
    out = put_u32(out, length);
    return put_u64(out, offset);
}

/* A batch frame's header; returns where the record frames go. */
static uint8_t *
put_batch_header(uint8_t *batch, uint32_t length, uint64_t base_offset, uint32_t count)
{
    return put_u32(put_frame_head(batch, 'B', length, base_offset), count);
}

/* A record frame's header; returns where the key and value lengths go. */
static uint8_t *
put_record_header(uint8_t *frame, uint32_t length, uint64_t offset, uint64_t timestamp_ms)
{
    return put_u64(put_frame_head(frame, 'R', length, offset), timestamp_ms);
}

static inline uint8_t *
put_nbytes(uint8_t *out, PyObject *part)
{
    Py_ssize_t size;
    if (part == Py_None) {
        return put_u32(out, NULL_LENGTH);
    }
    size = PyBytes_GET_SIZE(part);
    out = put_u32(out, (uint32_t)size);
    memcpy(out, PyBytes_AS_STRING(part), (size_t)size);
    return out + size;
}

/* One record's fields, held (new references) between measuring and writing. */
typedef struct {
    PyObject *key;
    PyObject *value;
    PyObject *headers;
    uint64_t timestamp_ms;
    uint32_t length;
} RecordFields;

static PyObject *str_key, *str_value, *str_timestamp_ms, *str_headers;

/* Adds the number of bytes a key, a value or a header part stores (not its u32 length) to
 * *size; -1 with an exception set if it is neither bytes nor (where allowed) None, or too long
 * for a u32 length. */
static int
measure_nbytes(PyObject *part, const char *what, int may_be_null, uint64_t *size)
{
    Py_ssize_t length;
    if (part == Py_None && may_be_null) {
        return 0;
    }
    if (!PyBytes_CheckExact(part)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes%s, not %.100s", what,
                     may_be_null ? " or None" : "", Py_TYPE(part)->tp_name);
        return -1;
    }
    length = PyBytes_GET_SIZE(part);
    if ((uint64_t)length >= NULL_LENGTH) {
        PyErr_Format(PyExc_ValueError, "%s of %zd bytes is too long for a record", what, length);
        return -1;
    }
    *size += (uint64_t)length;
    return 0;
}

static int
read_timestamp(PyObject *record, uint64_t *timestamp_ms)
{
    PyObject *timestamp = PyObject_GetAttr(record, str_timestamp_ms);
    if (timestamp == NULL) {
        return -1;
    }
    if (!PyLong_Check(timestamp)) {
        PyErr_Format(PyExc_TypeError, "timestamp_ms must be an int, not %.100s",
                     Py_TYPE(timestamp)->tp_name);
        Py_DECREF(timestamp);
        return -1;
    }
    *timestamp_ms = PyLong_AsUnsignedLongLong(timestamp);
    Py_DECREF(timestamp);
    return (*timestamp_ms == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* Reads and checks one record's fields into *fields and sets its frame length; -1 with an
 * exception set on a field the format cannot hold. */
static int
measure_record(PyObject *record, RecordFields *fields)
{
    uint64_t length = RECORD_FIXED_SIZE + 4; /* and the header count */
    Py_ssize_t count;

    fields->key = PyObject_GetAttr(record, str_key);
    fields->value = fields->key ? PyObject_GetAttr(record, str_value) : NULL;
    fields->headers = fields->value ? PyObject_GetAttr(record, str_headers) : NULL;
    if (fields->headers == NULL || read_timestamp(record, &fields->timestamp_ms) < 0 ||
        measure_nbytes(fields->key, "key", 1, &length) < 0 ||
        measure_nbytes(fields->value, "value", 0, &length) < 0) {
        return -1;
    }
    if (!PyTuple_CheckExact(fields->headers)) {
        PyErr_Format(PyExc_TypeError, "headers must be a tuple, not %.100s",
                     Py_TYPE(fields->headers)->tp_name);
        return -1;
    }
    count = PyTuple_GET_SIZE(fields->headers);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *header = PyTuple_GET_ITEM(fields->headers, i);
        if (!PyTuple_CheckExact(header) || PyTuple_GET_SIZE(header) != 2) {
            PyErr_SetString(PyExc_TypeError, "each header must be a (name, value) tuple");
            return -1;
        }
        length += 8; /* the name's and the value's u32 lengths */
        if (measure_nbytes(PyTuple_GET_ITEM(header, 0), "header name", 1, &length) < 0 ||
            measure_nbytes(PyTuple_GET_ITEM(header, 1), "header value", 1, &length) < 0) {
            return -1;
        }
    }
    if (length > MAX_FRAME_SIZE) {
        PyErr_Format(PyExc_ValueError, "record of %llu bytes is too large to store",
                     (unsigned long long)length);
        return -1;
    }
    fields->length = (uint32_t)length;
    return 0;
}

static uint8_t *
write_record(uint8_t *out, const RecordFields *fields, uint64_t offset)
{
    uint8_t *frame = out;
    Py_ssize_t count = PyTuple_GET_SIZE(fields->headers);
    out = put_record_header(out, fields->length, offset, fields->timestamp_ms);
    if (fields->key == Py_None) {
        out = put_u32(out, NULL_LENGTH);
    }
    else {
        out = put_u32(out, (uint32_t)PyBytes_GET_SIZE(fields->key));
    }
    out = put_u32(out, (uint32_t)PyBytes_GET_SIZE(fields->value));
    if (fields->key != Py_None) {
        memcpy(out, PyBytes_AS_STRING(fields->key), (size_t)PyBytes_GET_SIZE(fields->key));
        out += PyBytes_GET_SIZE(fields->key);
    }
    memcpy(out, PyBytes_AS_STRING(fields->value), (size_t)PyBytes_GET_SIZE(fields->value));
    out += PyBytes_GET_SIZE(fields->value);
    out = put_u32(out, (uint32_t)count);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *header = PyTuple_GET_ITEM(fields->headers, i);
        out = put_nbytes(out, PyTuple_GET_ITEM(header, 0));
        out = put_nbytes(out, PyTuple_GET_ITEM(header, 1));
    }
    put_u32(frame, crc32c_extend(0, frame + 4, fields->length - 4));
    return out;
}

static void
release_fields(RecordFields *fields, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(fields[i].key);
        Py_XDECREF(fields[i].value);
        Py_XDECREF(fields[i].headers);
    }
    PyMem_Free(fields);
}

PyDoc_STRVAR(encode_batch_doc,
             "encode_batch(base_offset, records, /)\n--\n\n"
             "Frame records as one batch whose first record takes base_offset.");

static PyObject *
encode_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *sequence = NULL, *result = NULL;
    RecordFields *fields = NULL;
    Py_ssize_t count = 0, measured = 0;
    uint64_t base_offset, length = BATCH_HEADER_SIZE;
    uint8_t *out, *batch;

    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "encode_batch expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    /* A tuple, not the caller's list: reading a record's attributes may run Python code, which
     * must not be able to change the sequence under this loop. */
    sequence = PySequence_Tuple(args[1]);
    if (sequence == NULL) {
        return NULL;
    }
    count = PyTuple_GET_SIZE(sequence);
    if (count == 0) {
        PyErr_SetString(PyExc_ValueError, "a batch holds at least one record");
        goto done;
    }
    if (!PyLong_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "base offset must be an int, not %.100s",
                     Py_TYPE(args[0])->tp_name);
        goto done;
    }
    base_offset = PyLong_AsUnsignedLongLong(args[0]);
    if ((base_offset == (uint64_t)-1 && PyErr_Occurred()) ||
        base_offset > UINT64_MAX - (uint64_t)count) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "base offset %S is out of range", args[0]);
        goto done;
    }
    fields = PyMem_Calloc((size_t)count, sizeof(RecordFields));
    if (fields == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; measured < count; measured++) {
        PyObject *record = PyTuple_GET_ITEM(sequence, measured);
        if (measure_record(record, &fields[measured]) < 0) {
            measured++; /* release what it took */
            goto done;
        }
        length += fields[measured].length;
        /* Checked per record: each adds at most 0xFFFFFFFF, so the sum cannot wrap first. */
        if (length > MAX_FRAME_SIZE || length > (uint64_t)PY_SSIZE_T_MAX) {
            measured++;
            PyErr_Format(PyExc_ValueError, "batch of %llu bytes or more is too large to store",
                         (unsigned long long)length);
            goto done;
        }
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
    if (result == NULL) {
        goto done;
    }
    batch = (uint8_t *)PyBytes_AS_STRING(result);
    out = put_batch_header(batch, (uint32_t)length, base_offset, (uint32_t)count);
    for (Py_ssize_t i = 0; i < count; i++) {
        out = write_record(out, &fields[i], base_offset + (uint64_t)i);
    }
    put_u32(batch, crc32c_extend(0, batch + 4, (size_t)length - 4));

done:
    if (fields != NULL) {
        release_fields(fields, measured);
    }
    Py_DECREF(sequence);
    return result;
}

/* -- consume: stored record frames to client protocol records ----------------------------
 *
 * A stored record frame (docs/storage-format.md):
 *   crc:u32 "LR" version:u8 flags:u8 length:u32 offset:u64 timestamp:u64 key_len:u32
 *   value_len:u32 key value header_count:u32 (nbytes name, nbytes value)*
 * with nbytes = len:u32 bytes, len 0xFFFFFFFF for null. A client protocol record
 * (docs/protocol.md):
 *   str(key) value_len:u32 value timestamp_ms:u64 header_count:u32 (str name, str value)*
 * with str = 0x00 for null, or 0x01 len:u32 bytes.
 *
 * The frames come from a batch whose checksum verified; their structure is still checked
 * against the region's bounds before anything is copied, so a bad frame raises ValueError
 * instead of reading past the buffer.
 */

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

/* Walks one stored nbytes field at *position (bounded by end); adds the size of its wire
 * form to *wire_size. -1 if it runs past the frame. */
static int
measure_stored_nbytes(const uint8_t *frame, size_t *position, size_t end, uint64_t *wire_size)
{
    uint32_t length;
    if (*position + 4 > end) {
        return -1;
    }
    length = get_u32(frame + *position);
    *position += 4;
    if (length == NULL_LENGTH) {
        *wire_size += 1;
        return 0;
    }
    if (length > end - *position) {
        return -1;
    }
    *position += length;
    *wire_size += 5 + (uint64_t)length;
    return 0;
}

static uint8_t *
put_stored_nbytes(uint8_t *out, const uint8_t *frame, size_t *position)
{
    uint32_t length = get_u32(frame + *position);
    *position += 4;
    if (length == NULL_LENGTH) {
        *out++ = 0x00;
        return out;
    }
    *out++ = 0x01;
    out = put_u32(out, length);
    memcpy(out, frame + *position, length);
    *position += length;
    return out + length;
}

/* Checks one record frame of `length` bytes and returns the size of its wire form, or -1. */
static int64_t
measure_frame(const uint8_t *frame, size_t length, uint64_t *key_value_bytes)
{
    size_t position = 36;
    uint32_t key_length, value_length, headers;
    uint64_t wire = 4 + 8 + 4; /* value length, timestamp, header count */
    if (length < 40 || frame[4] != 'L' || frame[5] != 'R') {
        return -1;
    }
    key_length = get_u32(frame + 28);
    value_length = get_u32(frame + 32);
    if (key_length == NULL_LENGTH) {
        wire += 1;
        key_length = 0;
    }
    else {
        wire += 5 + (uint64_t)key_length;
    }
    if (value_length == NULL_LENGTH || (uint64_t)key_length + value_length > length - 40) {
        return -1;
    }
    position += (size_t)key_length + value_length;
    wire += value_length;
    *key_value_bytes = (uint64_t)key_length + value_length;
    headers = get_u32(frame + position);
    position += 4;
    for (uint32_t i = 0; i < 2 * (uint64_t)headers; i++) {
        if (measure_stored_nbytes(frame, &position, length, &wire) < 0) {
            return -1;
        }
    }
    if (position != length) {
        return -1;
    }
    return (int64_t)wire;
}

static uint8_t *
write_frame(uint8_t *out, const uint8_t *frame)
{
    uint32_t key_length = get_u32(frame + 28);
    uint32_t value_length = get_u32(frame + 32);
    size_t position = 36;
    uint32_t headers;
    if (key_length == NULL_LENGTH) {
        *out++ = 0x00;
    }
    else {
        *out++ = 0x01;
        out = put_u32(out, key_length);
        memcpy(out, frame + position, key_length);
        out += key_length;
        position += key_length;
    }
    out = put_u32(out, value_length);
    memcpy(out, frame + position, value_length);
    out += value_length;
    position += value_length;
    memcpy(out, frame + 20, 8); /* the timestamp: big-endian u64 in both */
    out += 8;
    headers = get_u32(frame + position);
    out = put_u32(out, headers);
    position += 4;
    for (uint32_t i = 0; i < 2 * (uint64_t)headers; i++) {
        out = put_stored_nbytes(out, frame, &position);
    }
    return out;
}

PyDoc_STRVAR(wire_records_doc,
             "wire_records(data, start, end, first_offset, max_records, max_bytes, /)\n--\n\n"
             "The record frames in data[start:end] from first_offset on, as client protocol\n"
             "records: (wire bytes, record count, next offset, key and value bytes). Stops at\n"
             "max_records, or once max_bytes of keys and values are taken (at least one\n"
             "record). Same result as logbroker.transcode.wire_records_python.");

static PyObject *
wire_records(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t start, end, max_records, max_bytes;
    unsigned long long first_offset, next_offset;
    const uint8_t *base;
    size_t position;
    uint64_t wire_size = 0, taken = 0;
    Py_ssize_t count = 0;
    size_t first = 0, stop;
    PyObject *result = NULL, *wire = NULL;
    uint8_t *out;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*nnKnn:wire_records", &data, &start, &end, &first_offset,
                          &max_records, &max_bytes)) {
        return NULL;
    }
    next_offset = first_offset;
    if (start < 0 || end < start || end > data.len) {
        PyErr_SetString(PyExc_ValueError, "wire_records: start and end must lie in data");
        goto done;
    }
    base = (const uint8_t *)data.buf;
    /* Pass 1: find the frames to take and the size of their wire form. */
    position = (size_t)start;
    stop = (size_t)start;
    while (position < (size_t)end) {
        uint32_t length;
        uint64_t offset, key_value = 0;
        int64_t size;
        if ((size_t)end - position < 40) {
            goto bad_frame;
        }
        length = get_u32(base + position + 8);
        if (length < 40 || length > (size_t)end - position) {
            goto bad_frame;
        }
        offset = get_u64(base + position + 12);
        if (offset < first_offset) {
            position += length;
            continue;
        }
        if (count >= max_records || (count > 0 && (int64_t)taken >= max_bytes)) {
            break;
        }
        size = measure_frame(base + position, length, &key_value);
        if (size < 0) {
            goto bad_frame;
        }
        if (count == 0) {
            first = position;
        }
        wire_size += (uint64_t)size;
        taken += key_value;
        count++;
        next_offset = offset + 1;
        position += length;
        stop = position;
    }
    if (wire_size > (uint64_t)PY_SSIZE_T_MAX) {
        PyErr_NoMemory();
        goto done;
    }
    wire = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)wire_size);
    if (wire == NULL) {
        goto done;
    }
    /* Pass 2: write them. */
    out = (uint8_t *)PyBytes_AS_STRING(wire);
    for (position = first; count > 0 && position < stop;) {
        uint32_t length = get_u32(base + position + 8);
        out = write_frame(out, base + position);
        position += length;
    }
    result = Py_BuildValue("(OnKK)", wire, count, next_offset, (unsigned long long)taken);
    goto done;

bad_frame:
    PyErr_Format(PyExc_ValueError, "wire_records: a record frame at byte %zu is malformed",
                 position);
done:
    Py_XDECREF(wire);
    PyBuffer_Release(&data);
    return result;
}

/* check_records: the replica's check of bytes a peer sent, record by record.
 *
 * Same result as logbroker.storage._format.check_batch_records_python for a batch whose header
 * scanned (its own checksum verified): first every record frame's header, bounds, checksum and
 * offset in order, then every frame's fields, so that the first damage reported is the one the
 * Python reference reports.
 */

/* The damage found, as (position, reason) with the reason a DamageReason value. */
static PyObject *
record_damage(size_t position, const char *reason)
{
    return Py_BuildValue("(ns)", (Py_ssize_t)position, reason);
}

PyDoc_STRVAR(check_records_doc,
             "check_records(data, batch_position, start, end, base_offset, count, /)\n--\n\n"
             "Check the count record frames in data[start:end] of the batch at batch_position:\n"
             "each one's header, checksum and offset (base_offset onwards), that they fill the\n"
             "batch exactly, and that their fields decode. None if they all do, else the first\n"
             "damage as (position, reason). Same result as\n"
             "logbroker.storage._format.check_batch_records_python.");

static PyObject *
check_records(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t batch_position, start, end, count;
    unsigned long long base_offset;
    const uint8_t *base;
    size_t position;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*nnnKn:check_records", &data, &batch_position, &start, &end,
                          &base_offset, &count)) {
        return NULL;
    }
    if (batch_position < 0 || start < batch_position || end < start || end > data.len ||
        count < 0) {
        PyErr_SetString(PyExc_ValueError, "check_records: the batch must lie in data");
        goto done;
    }
    base = (const uint8_t *)data.buf;
    position = (size_t)start;
    for (Py_ssize_t index = 0; index < count; index++) {
        const uint8_t *frame = base + position;
        uint32_t length;
        uint64_t offset;
        if ((size_t)end - position < 28) {
            result = record_damage(position, "header");
            goto done;
        }
        length = get_u32(frame + 8);
        if (frame[4] != 'L' || frame[5] != 'R' || frame[6] != FORMAT_VERSION || frame[7] != 0 ||
            length < 40 || length > (size_t)end - position) {
            result = record_damage(position, "header");
            goto done;
        }
        if (crc32c_extend(0, frame + 4, length - 4) != get_u32(frame)) {
            result = record_damage(position, "checksum");
            goto done;
        }
        offset = get_u64(frame + 12);
        if ((uint64_t)index > UINT64_MAX - base_offset ||
            offset != base_offset + (uint64_t)index) {
            result = record_damage(position, "sequence");
            goto done;
        }
        position += length;
    }
    if (position != (size_t)end) {
        result = record_damage((size_t)batch_position, "header");
        goto done;
    }
    position = (size_t)start;
    for (Py_ssize_t index = 0; index < count; index++) {
        uint32_t length = get_u32(base + position + 8);
        uint64_t key_value = 0;
        if (measure_frame(base + position, length, &key_value) < 0) {
            result = record_damage(position, "header");
            goto done;
        }
        position += length;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    return result;
}

/* -- produce: client protocol records straight to stored frames ---------------------------
 *
 * A produce's records stay in the bytes they came in (logbroker.records.WireRecords) from the
 * client port to the log: logbroker/wire/_speedups.c checks them once where they enter (a
 * request, a forwarded share), split_wire_records cuts them into their ranges' shares by key
 * (here, beside the CRC32C it hashes keys with), and frame_wire_records turns a share into the
 * batch frame the log stores, with the offsets the log gives it. No Python object is made per
 * record (docs/decisions/0022-a-produce-stays-in-its-wire-bytes.md).
 *
 * Each function returns None where the bytes are not exactly `count` valid records: the
 * callers then take the Python path (logbroker.key_routing, logbroker.transcode), which
 * raises the protocol's error for exactly what is wrong. The tests hold both paths to the same
 * results.
 */

#include "../wire/_wire_record.h"

/* Copies one wire header part (name or value) as stored nbytes. */
static uint8_t *
put_wire_part(uint8_t *out, const uint8_t **headers)
{
    const uint8_t *part = *headers;
    uint32_t length;
    if (part[0] == 0x00) {
        *headers = part + 1;
        return put_u32(out, NULL_LENGTH);
    }
    length = get_u32(part + 1);
    out = put_u32(out, length);
    memcpy(out, part + 5, length);
    *headers = part + 5 + length;
    return out + length;
}

static uint8_t *
write_wire_record(uint8_t *out, const WireRecord *record, uint64_t offset)
{
    uint8_t *frame = out;
    const uint8_t *headers = record->headers;
    out = put_record_header(out, (uint32_t)record->stored_length, offset, record->timestamp_ms);
    out = put_u32(out, record->key == NULL ? NULL_LENGTH : record->key_length);
    out = put_u32(out, record->value_length);
    if (record->key != NULL) {
        memcpy(out, record->key, record->key_length);
        out += record->key_length;
    }
    memcpy(out, record->value, record->value_length);
    out += record->value_length;
    out = put_u32(out, record->header_count);
    for (uint32_t i = 0; i < 2 * record->header_count; i++) {
        out = put_wire_part(out, &headers);
    }
    put_u32(frame, crc32c_extend(0, frame + 4, (size_t)record->stored_length - 4));
    return out;
}

PyDoc_STRVAR(frame_wire_records_doc,
             "frame_wire_records(base_offset, data, count, /)\n--\n\n"
             "The batch frame of the count client protocol records that fill data, the first\n"
             "taking base_offset: the bytes encode_batch gives for the same records. None if\n"
             "data is not exactly count valid records.");

static PyObject *
frame_wire_records(PyObject *module, PyObject *args)
{
    Py_buffer data;
    unsigned long long base_offset;
    Py_ssize_t count;
    size_t position = 0;
    uint64_t length = BATCH_HEADER_SIZE;
    WireRecord record;
    PyObject *result = NULL;
    uint8_t *batch, *out;

    (void)module;
    if (!PyArg_ParseTuple(args, "Ky*n:frame_wire_records", &base_offset, &data, &count)) {
        return NULL;
    }
    if (count <= 0) {
        PyErr_SetString(PyExc_ValueError, "a batch holds at least one record");
        goto done;
    }
    if ((uint64_t)count - 1 > UINT64_MAX - base_offset) {
        PyErr_Format(PyExc_ValueError, "base offset %llu is out of range", base_offset);
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (parse_wire_record(data.buf, (size_t)data.len, &position, &record) < 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        length += record.stored_length;
        if (length > MAX_FRAME_SIZE || length > (uint64_t)PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_ValueError, "batch of %llu bytes or more is too large to store",
                         (unsigned long long)length);
            goto done;
        }
    }
    if (position != (size_t)data.len) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
    if (result == NULL) {
        goto done;
    }
    batch = (uint8_t *)PyBytes_AS_STRING(result);
    out = put_batch_header(batch, (uint32_t)length, base_offset, (uint32_t)count);
    position = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        parse_wire_record(data.buf, (size_t)data.len, &position, &record);
        out = write_wire_record(out, &record, base_offset + (uint64_t)i);
    }
    put_u32(batch, crc32c_extend(0, batch + 4, (size_t)length - 4));
done:
    PyBuffer_Release(&data);
    return result;
}

/* One range's share while split_wire_records builds it. */
typedef struct {
    Py_ssize_t count;
    size_t bytes;
    uint64_t size;
    uint8_t *out;
} Share;

PyDoc_STRVAR(split_wire_records_doc,
             "split_wire_records(data, count, bits, starts, keyless, /)\n--\n\n"
             "Cut the count client protocol records that fill data into their ranges' shares:\n"
             "a keyed record goes to the range whose start (starts: the active ranges' first\n"
             "slots, ascending, the first 0) is the last at or below its key's slot (the top\n"
             "bits bits of CRC32C of the key), a keyless one to range number keyless. A list\n"
             "of (range number, count, bytes, key and value bytes) for each range that takes\n"
             "records, in range order; None if data is not exactly count valid records.");

static PyObject *
split_wire_records(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t count, ranges, keyless, used = 0;
    int bits;
    PyObject *starts_object, *result = NULL, *starts_sequence = NULL;
    uint32_t *starts = NULL, *owners = NULL;
    Share *shares = NULL;
    size_t position = 0;
    WireRecord record;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*niOn:split_wire_records", &data, &count, &bits,
                          &starts_object, &keyless)) {
        return NULL;
    }
    starts_sequence = PySequence_Fast(starts_object, "starts must be a sequence");
    if (starts_sequence == NULL) {
        goto done;
    }
    ranges = PySequence_Fast_GET_SIZE(starts_sequence);
    if (count < 0 || bits < 1 || bits > 32 || ranges < 1 || keyless < 0 || keyless >= ranges) {
        PyErr_SetString(PyExc_ValueError,
                        "split_wire_records: needs count >= 0, bits in 1..32, a range and "
                        "keyless among them");
        goto done;
    }
    starts = PyMem_Malloc((size_t)ranges * sizeof(uint32_t));
    owners = PyMem_Malloc(((size_t)count + 1) * sizeof(uint32_t));
    shares = PyMem_Calloc((size_t)ranges, sizeof(Share));
    if (starts == NULL || owners == NULL || shares == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ranges; i++) {
        unsigned long start = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(starts_sequence, i));
        if (start == (unsigned long)-1 && PyErr_Occurred()) {
            goto done;
        }
        if (start > UINT32_MAX || (i == 0 && start != 0) || (i > 0 && start <= starts[i - 1])) {
            PyErr_SetString(PyExc_ValueError,
                            "split_wire_records: starts must ascend from 0 within 32 bits");
            goto done;
        }
        starts[i] = (uint32_t)start;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t record_start = position;
        uint32_t owner = (uint32_t)keyless;
        if (parse_wire_record(data.buf, (size_t)data.len, &position, &record) < 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (record.key != NULL) {
            uint32_t slot = crc32c_extend(0, record.key, record.key_length) >> (32 - bits);
            /* The last start at or below the slot (bisect_right - 1); starts[0] is 0. */
            Py_ssize_t low = 0, high = ranges;
            while (high - low > 1) {
                Py_ssize_t middle = (low + high) / 2;
                if (starts[middle] <= slot) {
                    low = middle;
                }
                else {
                    high = middle;
                }
            }
            owner = (uint32_t)low;
        }
        owners[i] = owner;
        if (shares[owner].count++ == 0) {
            used++;
        }
        shares[owner].bytes += position - record_start;
        shares[owner].size += record.value_length + (record.key == NULL ? 0 : record.key_length);
    }
    if (position != (size_t)data.len) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyList_New(used);
    if (result == NULL) {
        goto done;
    }
    used = 0;
    for (Py_ssize_t i = 0; i < ranges; i++) {
        PyObject *bytes, *entry;
        if (shares[i].count == 0) {
            continue;
        }
        /* One range takes every record: its share is the bytes as they came. */
        if (shares[i].count == count && PyBytes_CheckExact(data.obj)) {
            bytes = Py_NewRef(data.obj);
        }
        else {
            bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)shares[i].bytes);
            if (bytes == NULL) {
                Py_CLEAR(result);
                goto done;
            }
            shares[i].out = (uint8_t *)PyBytes_AS_STRING(bytes);
        }
        entry = Py_BuildValue("(nnNK)", i, shares[i].count, bytes,
                              (unsigned long long)shares[i].size);
        if (entry == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, used++, entry);
    }
    position = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t record_start = position;
        Share *share = &shares[owners[i]];
        parse_wire_record(data.buf, (size_t)data.len, &position, &record);
        if (share->out != NULL) {
            memcpy(share->out, (const uint8_t *)data.buf + record_start, position - record_start);
            share->out += position - record_start;
        }
    }
done:
    PyMem_Free(starts);
    PyMem_Free(owners);
    PyMem_Free(shares);
    Py_XDECREF(starts_sequence);
    PyBuffer_Release(&data);
    return result;
}

/* scan_sealed: the sealed files' view of a segment's log, for seal_copy, a roll and an install.
 *
 * Same result as logbroker.storage._segment.scan_sealed_python: the whole of data must be
 * batches that verify (sane header, checksum, the offset the stream expects there, record
 * frames of at least 40 bytes that fill the batch exactly), or the answer is None. Otherwise it
 * is (index, next offset, largest record timestamp), the index as (offset, position) pairs by
 * the sparse index's rule: the first batch, then the first batch starting interval bytes or
 * more after the previous entry's batch.
 */

#define STAMPED_BATCH_VERSION 2
#define STAMP_SIZE 16
#define MIN_RECORD_SIZE 40

PyDoc_STRVAR(scan_sealed_doc,
             "scan_sealed(data, base_offset, interval, /)\n--\n\n"
             "(index, next_offset, max_timestamp) of a log that is whole, verified batches from\n"
             "base_offset on, else None. Same result as\n"
             "logbroker.storage._segment.scan_sealed_python.");

/* One sparse index entry, kept in C while the GIL is released. */
typedef struct {
    uint64_t offset;
    size_t position;
} index_entry;

/* The scan of scan_sealed, with no Python object touched: the GIL is released around it (a
 * verification of a 64 MiB segment runs on a reader thread beside the reactor). Returns 1 if
 * data is whole, 0 if not, -1 if out of memory; fills *entries (malloc'ed, the caller frees it),
 * *count, *next_offset and *largest. */
static int
scan_sealed_nogil(const uint8_t *base, size_t size, uint64_t base_offset, size_t interval,
                  index_entry **entries, size_t *count, uint64_t *next_offset, uint64_t *largest)
{
    size_t position = 0, last_entry = 0, room = 0;
    uint64_t expected = base_offset;
    *entries = NULL;
    *count = 0;
    *largest = 0;
    while (position < size) {
        const uint8_t *batch = base + position;
        uint32_t length, records;
        size_t header, record, end;
        if (size - position < BATCH_HEADER_SIZE) {
            return 0;
        }
        length = get_u32(batch + 8);
        records = get_u32(batch + 20);
        if (batch[4] != 'L' || batch[5] != 'B' || batch[7] != 0 || records < 1) {
            return 0;
        }
        if (batch[6] == FORMAT_VERSION) {
            header = BATCH_HEADER_SIZE;
        }
        else if (batch[6] == STAMPED_BATCH_VERSION) {
            header = BATCH_HEADER_SIZE + STAMP_SIZE;
        }
        else {
            return 0;
        }
        if ((uint64_t)length < header + (uint64_t)records * MIN_RECORD_SIZE ||
            length > size - position) {
            return 0;
        }
        if (crc32c_extend(0, batch + 4, length - 4) != get_u32(batch) ||
            get_u64(batch + 12) != expected || (uint64_t)records > UINT64_MAX - expected) {
            return 0;
        }
        end = position + length;
        record = position + header;
        for (uint32_t i = 0; i < records; i++) {
            uint32_t record_length;
            uint64_t timestamp;
            if (end - record < MIN_RECORD_SIZE) {
                return 0;
            }
            record_length = get_u32(base + record + 8);
            if (record_length < MIN_RECORD_SIZE || record_length > end - record) {
                return 0;
            }
            timestamp = get_u64(base + record + 20);
            if (timestamp > *largest) {
                *largest = timestamp;
            }
            record += record_length;
        }
        if (record != end) {
            return 0;
        }
        if (*count == 0 || position - last_entry >= interval) {
            if (*count == room) {
                size_t grown = room ? room * 2 : 64;
                index_entry *more = realloc(*entries, grown * sizeof(index_entry));
                if (more == NULL) {
                    return -1;
                }
                *entries = more;
                room = grown;
            }
            (*entries)[*count].offset = expected;
            (*entries)[*count].position = position;
            *count += 1;
            last_entry = position;
        }
        expected += records;
        position = end;
    }
    *next_offset = expected;
    return *count > 0;
}

static PyObject *
scan_sealed(PyObject *module, PyObject *args)
{
    Py_buffer data;
    unsigned long long base_offset;
    Py_ssize_t interval;
    index_entry *entries = NULL;
    size_t count = 0;
    uint64_t next_offset = 0, largest = 0;
    int whole;
    PyObject *index = NULL, *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*Kn:scan_sealed", &data, &base_offset, &interval)) {
        return NULL;
    }
    if (interval < 0) {
        PyErr_SetString(PyExc_ValueError, "scan_sealed: the interval must not be negative");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    whole = scan_sealed_nogil((const uint8_t *)data.buf, (size_t)data.len, base_offset,
                              (size_t)interval, &entries, &count, &next_offset, &largest);
    Py_END_ALLOW_THREADS
    if (whole < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (whole == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    index = PyList_New((Py_ssize_t)count);
    if (index == NULL) {
        goto done;
    }
    for (size_t i = 0; i < count; i++) {
        PyObject *entry = Py_BuildValue("(Kn)", (unsigned long long)entries[i].offset,
                                        (Py_ssize_t)entries[i].position);
        if (entry == NULL) {
            goto done;
        }
        PyList_SET_ITEM(index, (Py_ssize_t)i, entry);
    }
    result = Py_BuildValue("(OKK)", index, (unsigned long long)next_offset,
                           (unsigned long long)largest);
done:
    free(entries);
    Py_XDECREF(index);
    PyBuffer_Release(&data);
    return result;
}

PyDoc_STRVAR(checksum_doc,
             "checksum(data, value=0, /, *, software=False)\n--\n\n"
             "CRC32C of data continuing from value, as crc32c.crc32c computes it; with software\n"
             "true, by the table-driven code that hosts without SSE4.2 use. For the tests that\n"
             "hold both implementations to the crc32c package.");

static PyObject *
checksum(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"", "", "software", NULL};
    Py_buffer data;
    PyObject *start = NULL;
    unsigned long value = 0;
    int software = 0;
    uint32_t crc;

    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|O!$p:checksum", keywords, &data,
                                     &PyLong_Type, &start, &software)) {
        return NULL;
    }
    if (start != NULL) {
        value = PyLong_AsUnsignedLong(start);
        if ((value == (unsigned long)-1 && PyErr_Occurred()) || value > 0xFFFFFFFFul) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "checksum start value %S is not a u32", start);
            PyBuffer_Release(&data);
            return NULL;
        }
    }
    crc = (software ? crc32c_software : crc32c_extend)((uint32_t)value, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

static PyMethodDef speedups_methods[] = {
    {"wire_records", (PyCFunction)wire_records, METH_VARARGS, wire_records_doc},
    {"check_records", (PyCFunction)check_records, METH_VARARGS, check_records_doc},
    {"frame_wire_records", (PyCFunction)frame_wire_records, METH_VARARGS,
     frame_wire_records_doc},
    {"split_wire_records", (PyCFunction)split_wire_records, METH_VARARGS,
     split_wire_records_doc},
    {"scan_sealed", (PyCFunction)scan_sealed, METH_VARARGS, scan_sealed_doc},
    {"encode_batch", (PyCFunction)(void (*)(void))encode_batch, METH_FASTCALL, encode_batch_doc},
    {"checksum", (PyCFunction)(void (*)(void))checksum, METH_VARARGS | METH_KEYWORDS,
     checksum_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "logbroker.storage._speedups",
    .m_doc = "Native hot paths of logbroker's storage format (see _format.py).",
    .m_size = -1,
    .m_methods = speedups_methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *module;
    crc32c_init();
    str_key = PyUnicode_InternFromString("key");
    str_value = PyUnicode_InternFromString("value");
    str_timestamp_ms = PyUnicode_InternFromString("timestamp_ms");
    str_headers = PyUnicode_InternFromString("headers");
    if (!str_key || !str_value || !str_timestamp_ms || !str_headers) {
        return NULL;
    }
    module = PyModule_Create(&speedups_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddStringConstant(module, "CRC32C_IMPLEMENTATION", crc32c_implementation) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
