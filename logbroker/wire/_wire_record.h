/* One client protocol record read in place, shared by the two extensions that read a
 * produce's records without making objects of them (logbroker/wire/_speedups.c checks them,
 * logbroker/storage/_speedups.c frames and splits them).
 *
 * record = str(key) value_len:u32 value timestamp_ms:u64 header_count:u32 (str str)*, with
 * str = 0x00 for null or 0x01 len:u32 bytes (docs/protocol.md). Besides the fields, the parse
 * measures the record's stored frame (docs/storage-format.md): a record the storage format
 * cannot hold is refused here as invalid, as the Python path refuses it.
 *
 * The file including this one defines get_u32, get_u64 and NULL_LENGTH first.
 */
#ifndef LOGBROKER_WIRE_RECORD_H
#define LOGBROKER_WIRE_RECORD_H

#include <stddef.h>
#include <stdint.h>

/* The stored record header (28 bytes) plus the key and value lengths. */
#define WIRE_RECORD_STORED_FIXED 36
#define WIRE_RECORD_MAX_FRAME 0xFFFFFFFFull

/* One client protocol record, as parse_wire_record finds it in the request's bytes. */
typedef struct {
    const uint8_t *key;      /* NULL for a null key */
    uint32_t key_length;
    const uint8_t *value;
    uint32_t value_length;
    uint64_t timestamp_ms;
    const uint8_t *headers;  /* the first header's name; header_count of them follow */
    uint32_t header_count;
    uint64_t stored_length;  /* the whole stored record frame */
} WireRecord;

/* Reads a wire string (0x00 null, or 0x01 len:u32 bytes) at *position; -1 if invalid. */
static int
parse_wire_str(const uint8_t *data, size_t size, size_t *position, const uint8_t **bytes,
               uint32_t *length)
{
    uint32_t found;
    if (*position >= size) {
        return -1;
    }
    if (data[*position] == 0x00) {
        *position += 1;
        *bytes = NULL;
        *length = NULL_LENGTH;
        return 0;
    }
    if (data[*position] != 0x01 || size - *position < 5) {
        return -1;
    }
    found = get_u32(data + *position + 1);
    if (found == NULL_LENGTH || found > size - *position - 5) {
        return -1;
    }
    *bytes = data + *position + 5;
    *length = found;
    *position += 5 + (size_t)found;
    return 0;
}

/* Reads one record at *position and measures its stored frame; -1 if it is not a valid
 * encoding or too large for a frame. */
static int
parse_wire_record(const uint8_t *data, size_t size, size_t *position, WireRecord *record)
{
    uint64_t length = WIRE_RECORD_STORED_FIXED + 4; /* and the header count */
    const uint8_t *part;
    uint32_t part_length;

    if (parse_wire_str(data, size, position, &record->key, &record->key_length) < 0) {
        return -1;
    }
    if (record->key != NULL) {
        length += record->key_length;
    }
    if (size - *position < 4) {
        return -1;
    }
    record->value_length = get_u32(data + *position);
    *position += 4;
    if (record->value_length == NULL_LENGTH || record->value_length > size - *position) {
        return -1;
    }
    record->value = data + *position;
    *position += record->value_length;
    length += record->value_length;
    if (size - *position < 12) {
        return -1;
    }
    record->timestamp_ms = get_u64(data + *position);
    record->header_count = get_u32(data + *position + 8);
    *position += 12;
    record->headers = data + *position;
    /* Two bytes at least per header: a count the bytes cannot hold is refused before it is
     * walked. */
    if (record->header_count > (size - *position) / 2) {
        return -1;
    }
    for (uint32_t i = 0; i < 2 * record->header_count; i++) {
        if (parse_wire_str(data, size, position, &part, &part_length) < 0) {
            return -1;
        }
        length += 4 + (part == NULL ? 0 : (uint64_t)part_length);
    }
    if (length > WIRE_RECORD_MAX_FRAME) {
        return -1;
    }
    record->stored_length = length;
    return 0;
}

#endif
