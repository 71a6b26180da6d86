#include "safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cursor.h"
#include "err.h"
#include "model.h"
#include "json.h"
#include "limits.h"

static const struct {
    const char *name;
    enum kv_dtype dtype;
} st_dtypes[] = {
    {"F64", KV_DTYPE_F64}, {"F32", KV_DTYPE_F32}, {"F16", KV_DTYPE_F16}, {"BF16", KV_DTYPE_BF16},
    {"I64", KV_DTYPE_I64}, {"I32", KV_DTYPE_I32}, {"I16", KV_DTYPE_I16}, {"I8", KV_DTYPE_I8},
    {"U8", KV_DTYPE_U8},   {"BOOL", KV_DTYPE_BOOL},
};

/* Dtypes the safetensors format defines that kvcal does not read: reported as
 * KV_EUNSUPPORTED rather than as a malformed file. */
static const char *const st_foreign_dtypes[] = {
    "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "U16", "U32", "U64", "C64",
};

#define ST_DTYPE_LIST "F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"

/* A tensor's position in the data section, for the layout pass. */
struct st_extent {
    uint64_t begin, end;
    int64_t idx; /* into the unsorted table */
};

static int extent_cmp(const void *pa, const void *pb) {
    const struct st_extent *a = pa, *b = pb;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    if (a->end != b->end) return a->end < b->end ? -1 : 1;
    return (a->idx > b->idx) - (a->idx < b->idx);
}

static int parse_metadata(const json_t *meta, const char *path, struct kv_st_file *out,
                          struct kv_err *err) {
    if (!json_is_object(meta))
        return kv_fail(err, KV_EFORMAT, path, 8, "__metadata__ is a json %s, expected an object",
                       kv_json_type_name(meta));
    size_t n = json_object_size(meta);
    if (n > KV_MAX_KV_PAIRS)
        return kv_fail(err, KV_EFORMAT, path, 8, "__metadata__ has %zu entries, above the limit %d",
                       n, KV_MAX_KV_PAIRS);
    out->meta_keys = calloc(n ? n : 1, sizeof *out->meta_keys);
    out->meta_vals = calloc(n ? n : 1, sizeof *out->meta_vals);
    if (!out->meta_keys || !out->meta_vals)
        return kv_fail(err, KV_ENOMEM, path, 8, "out of memory for __metadata__");
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)meta, key, val) {
        if (!json_is_string(val)) {
            char found[64];
            kv_json_repr(val, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, 8,
                           "__metadata__ key '%s' maps to %s, expected a string", key, found);
        }
        int64_t i = out->n_meta;
        out->meta_keys[i] = strdup(key);
        out->meta_vals[i] = strdup(json_string_value(val));
        if (out->meta_keys[i] || out->meta_vals[i]) out->n_meta++; /* so clear frees them */
        if (!out->meta_keys[i] || !out->meta_vals[i])
            return kv_fail(err, KV_ENOMEM, path, 8, "out of memory for __metadata__");
    }
    return KV_OK;
}

/* Validate one tensor entry of the header (offset 8 for all its problems)
 * and fill t (all but offset and data) and its extent. */
static int parse_entry(const char *name, const json_t *val, const char *path, struct kv_tensor *t,
                       struct st_extent *ext, struct kv_err *err) {
    size_t name_len = strlen(name);
    if (name_len == 0) return kv_fail(err, KV_EFORMAT, path, 8, "tensor name is empty");
    if (name_len > KV_MAX_NAME_LEN)
        return kv_fail(err, KV_EFORMAT, path, 8,
                       "tensor name '%.40s...' is %zu bytes, above the limit %d", name, name_len,
                       KV_MAX_NAME_LEN);
    if (!json_is_object(val))
        return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s': entry is a json %s, expected an object",
                       name, kv_json_type_name(val));
    memcpy(t->name, name, name_len + 1);
    char found[64];

    /* dtype */
    json_t *jd = json_object_get(val, "dtype");
    if (!jd) return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s': missing 'dtype'", name);
    if (!json_is_string(jd)) {
        kv_json_repr(jd, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s': dtype must be a string, found %s",
                       name, found);
    }
    const char *ds = json_string_value(jd);
    size_t di = 0, nd_types = sizeof st_dtypes / sizeof st_dtypes[0];
    while (di < nd_types && strcmp(ds, st_dtypes[di].name) != 0) di++;
    if (di == nd_types) {
        int foreign = 0;
        for (size_t i = 0; i < sizeof st_foreign_dtypes / sizeof st_foreign_dtypes[0]; i++)
            foreign |= strcmp(ds, st_foreign_dtypes[i]) == 0;
        return kv_fail(err, foreign ? KV_EUNSUPPORTED : KV_EFORMAT, path, 8,
                       "tensor '%s': unknown dtype '%.32s', expected one of " ST_DTYPE_LIST, name,
                       ds);
    }
    t->dtype = st_dtypes[di].dtype;

    /* shape */
    json_t *js = json_object_get(val, "shape");
    if (!js) return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s': missing 'shape'", name);
    if (!json_is_array(js)) {
        kv_json_repr(js, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s': shape must be an array, found %s",
                       name, found);
    }
    size_t nd = json_array_size(js);
    if (nd > KV_MAX_DIMS)
        return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s': shape has %zu dims, above the limit %d",
                       name, nd, KV_MAX_DIMS);
    uint64_t need = kv_dtype_size(t->dtype);
    int overflow = 0;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0) {
            kv_json_repr(d, found, sizeof found);
            return kv_fail(err, KV_EFORMAT, path, 8,
                           "tensor '%s': shape[%zu] is %s, expected a non-negative integer", name, i,
                           found);
        }
        t->shape[i] = (int64_t)json_integer_value(d);
        if (!kv_mul_u64(need, (uint64_t)t->shape[i], &need)) overflow = 1;
    }
    t->ndim = (int)nd;
    char shape_s[128];
    kv_shape_str(shape_s, sizeof shape_s, t->shape, t->ndim);
    if (overflow)
        return kv_fail(err, KV_EFORMAT, path, 8,
                       "tensor '%s': shape %s %s needs more than 2^64 bytes", name, shape_s, ds);

    /* data_offsets */
    json_t *jo = json_object_get(val, "data_offsets");
    if (!jo) return kv_fail(err, KV_EFORMAT, path, 8, "tensor '%s': missing 'data_offsets'", name);
    json_t *jb = json_array_get(jo, 0), *je = json_array_get(jo, 1);
    if (!json_is_array(jo) || json_array_size(jo) != 2 || !json_is_integer(jb) ||
        !json_is_integer(je) || json_integer_value(jb) < 0 ||
        json_integer_value(je) < json_integer_value(jb)) {
        kv_json_repr(jo, found, sizeof found);
        return kv_fail(err, KV_EFORMAT, path, 8,
                       "tensor '%s': data_offsets must be [begin, end] with 0 <= begin <= end, "
                       "found %s",
                       name, found);
    }
    ext->begin = (uint64_t)json_integer_value(jb);
    ext->end = (uint64_t)json_integer_value(je);
    uint64_t span = ext->end - ext->begin;
    if (span != need)
        return kv_fail(err, KV_EFORMAT, path, 8,
                       "tensor '%s': data_offsets span %llu bytes but shape %s %s needs %llu", name,
                       (unsigned long long)span, shape_s, ds, (unsigned long long)need);
    t->nbytes = need;
    return KV_OK;
}

/* Sorted by begin, the extents must tile [0, data_len) exactly. */
static int check_layout(const struct st_extent *ext, int64_t n, const struct kv_tensor *tab,
                        uint64_t data_start, uint64_t data_len, const char *path,
                        struct kv_err *err) {
    uint64_t prev_end = 0;
    const char *prev = NULL;
    for (int64_t i = 0; i < n; i++) {
        const struct st_extent *e = &ext[i];
        const char *name = tab[e->idx].name;
        /* begin <= INT64_MAX and data_start <= 8 + KV_MAX_ST_HEADER: no overflow */
        uint64_t at = data_start + e->begin;
        if (e->begin < prev_end)
            return kv_fail(err, KV_EFORMAT, path, at,
                           "tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s', which "
                           "ends at %llu",
                           name, (unsigned long long)e->begin, (unsigned long long)e->end, prev,
                           (unsigned long long)prev_end);
        if (e->begin > prev_end) {
            if (prev)
                return kv_fail(err, KV_EFORMAT, path, at,
                               "tensor '%s': data_offsets begin %llu leaves a gap of %llu bytes "
                               "after tensor '%s', which ends at %llu",
                               name, (unsigned long long)e->begin,
                               (unsigned long long)(e->begin - prev_end), prev,
                               (unsigned long long)prev_end);
            return kv_fail(err, KV_EFORMAT, path, at,
                           "tensor '%s': data_offsets begin %llu leaves a gap of %llu bytes at "
                           "the start of the data",
                           name, (unsigned long long)e->begin, (unsigned long long)e->begin);
        }
        if (e->end > data_len)
            return kv_fail(err, KV_EFORMAT, path, at,
                           "truncated: tensor '%s' data_offsets end %llu exceeds the %llu data "
                           "bytes in the file",
                           name, (unsigned long long)e->end, (unsigned long long)data_len);
        prev_end = e->end;
        prev = name;
    }
    if (prev_end != data_len) {
        if (!prev)
            return kv_fail(err, KV_EFORMAT, path, data_start,
                           "header lists no tensors but %llu data bytes follow it",
                           (unsigned long long)data_len);
        return kv_fail(err, KV_EFORMAT, path, data_start + prev_end,
                       "tensor '%s' ends the data at %llu but the file has %llu data bytes "
                       "(%llu trailing)",
                       prev, (unsigned long long)prev_end, (unsigned long long)data_len,
                       (unsigned long long)(data_len - prev_end));
    }
    return KV_OK;
}

static int parse_header(const uint8_t *buf, uint64_t len, const char *path,
                        struct kv_st_file *out, struct kv_err *err) {
    struct kv_cursor c;
    kv_cur_init(&c, buf, len, path, err);
    uint64_t hlen;
    if (len < 8)
        return kv_fail(err, KV_EFORMAT, path, 0,
                       "file is %llu bytes, too short for the 8-byte header length",
                       (unsigned long long)len);
    int rc = kv_cur_u64(&c, &hlen, "header length");
    if (rc) return rc;
    if (hlen > len)
        return kv_fail(err, KV_EFORMAT, path, 0, "header length %llu exceeds file size %llu",
                       (unsigned long long)hlen, (unsigned long long)len);
    if (hlen > kv_cur_left(&c))
        return kv_fail(err, KV_EFORMAT, path, 0,
                       "header length %llu exceeds the %llu bytes after the length field",
                       (unsigned long long)hlen, (unsigned long long)kv_cur_left(&c));
    if (hlen > KV_MAX_ST_HEADER)
        return kv_fail(err, KV_EFORMAT, path, 0, "header length %llu exceeds the limit %llu",
                       (unsigned long long)hlen, (unsigned long long)KV_MAX_ST_HEADER);
    const uint8_t *hdr;
    rc = kv_cur_bytes(&c, hlen, &hdr, "header");
    if (rc) return rc;
    out->header_len = hlen;
    out->data_start = 8 + hlen;

    json_t *root;
    rc = kv_json_parse((const char *)hdr, (size_t)hlen, path, 8, &root, err);
    if (rc) return rc;
    struct st_extent *ext = NULL;
    struct kv_tensor *tab = NULL;
    if (!json_is_object(root)) {
        rc = kv_fail(err, KV_EFORMAT, path, 8, "header is a json %s, expected an object",
                     kv_json_type_name(root));
        goto done;
    }
    size_t n_keys = json_object_size(root);
    if (n_keys > (size_t)KV_MAX_TENSORS + 1) {
        rc = kv_fail(err, KV_EFORMAT, path, 8, "header has %zu entries, above the limit %d",
                     n_keys, KV_MAX_TENSORS);
        goto done;
    }
    ext = calloc(n_keys ? n_keys : 1, sizeof *ext);
    tab = calloc(n_keys ? n_keys : 1, sizeof *tab);
    out->tensors = calloc(n_keys ? n_keys : 1, sizeof *out->tensors);
    if (!ext || !tab || !out->tensors) {
        rc = kv_fail(err, KV_ENOMEM, path, 8, "out of memory for %zu tensors", n_keys);
        goto done;
    }
    int64_t n = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            rc = parse_metadata(val, path, out, err);
        } else {
            rc = parse_entry(key, val, path, &tab[n], &ext[n], err);
            ext[n].idx = n;
            n++;
        }
        if (rc) goto done;
    }
    qsort(ext, (size_t)n, sizeof *ext, extent_cmp);
    rc = check_layout(ext, n, tab, out->data_start, len - out->data_start, path, err);
    if (rc) goto done;
    for (int64_t i = 0; i < n; i++) {
        struct kv_tensor *t = &out->tensors[i];
        *t = tab[ext[i].idx];
        t->offset = out->data_start + ext[i].begin;
        t->data = buf + t->offset;
        t->file = 0;
    }
    out->n_tensors = n;
done:
    free(ext);
    free(tab);
    json_decref(root);
    return rc;
}

int kv_st_parse(const uint8_t *buf, uint64_t len, const char *path, struct kv_st_file *out,
                struct kv_err *err) {
    memset(out, 0, sizeof *out);
    int rc = parse_header(buf, len, path, out, err);
    if (rc) kv_st_clear(out);
    return rc;
}

void kv_st_clear(struct kv_st_file *f) {
    if (!f) return;
    for (int64_t i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_vals[i]);
    }
    free(f->meta_keys);
    free(f->meta_vals);
    free(f->tensors);
    struct kv_map keep = f->map;
    memset(f, 0, sizeof *f);
    f->map = keep;
}

int kv_st_open(const char *path, struct kv_st_file **out, struct kv_err *err) {
    struct kv_map map;
    int rc = kv_map_open(path, &map, err);
    if (rc) return rc;
    struct kv_st_file *f = malloc(sizeof *f);
    if (!f) {
        kv_map_close(&map);
        return kv_fail(err, KV_ENOMEM, path, KV_NO_OFFSET, "out of memory");
    }
    rc = kv_st_parse(map.data, map.len, path, f, err);
    if (rc) {
        kv_map_close(&map);
        free(f);
        return rc;
    }
    f->map = map;
    *out = f;
    return KV_OK;
}

void kv_st_close(struct kv_st_file *f) {
    if (!f) return;
    kv_st_clear(f);
    kv_map_close(&f->map);
    free(f);
}

const struct kv_tensor *kv_st_find(const struct kv_st_file *f, const char *name) {
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

const char *kv_st_meta(const struct kv_st_file *f, const char *key) {
    for (int64_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_vals[i];
    return NULL;
}
