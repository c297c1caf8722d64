/* Native helpers of the loading path: region-of-interest JPEG decoding through libjpeg-turbo's
 * scanline API (the DALI approach), whole batches of JPEGs in one call (decode_batch), the HWC ->
 * CHW transpose of a decoded image, and the tar parser's common case (tar_samples, tar_at). Each exists
 * because per-image Python measured as a visible share of a worker's time (docs/loader.md).
 *
 * A random-resized crop keeps on average about half of an image. TurboJPEG's one-call API (what
 * simplejpeg and Pillow use) decodes every pixel anyway; libjpeg-turbo's scanline API can do less:
 * jpeg_crop_scanline() limits the inverse DCT, upsampling and colour conversion to the crop's
 * columns (widened to whole iMCUs), jpeg_skip_scanlines() passes over the rows above the crop
 * without producing pixels, and decoding stops after the crop's last row. No PyPI wheel exposes
 * those two calls for the libjpeg-turbo that Debian ships (PyTurboJPEG needs TurboJPEG 3), so this
 * small module binds them; it is optional at build time and shardkit falls back to full decodes
 * without it.
 *
 * decode(data, scale_denom, top, left, height, width, fast=False) -> (bytearray, x0, out_width)
 *   Coordinates are in the scaled image (after 1/scale_denom DCT scaling). The bytearray holds
 *   `height` rows of `out_width` RGB pixels starting at scaled column x0 <= left, with
 *   x0 + out_width >= left + width; its pixels equal a full decode's at the same scale. The GIL
 *   is released while pixels are decoded.
 *   Raises ValueError for data libjpeg cannot decode (the caller falls back).
 *
 * hwc_to_chw(src, dst): dst (3*H*W bytes, planar) = src (H*W*3, interleaved) transposed. A JPEG
 *   decodes pixel-interleaved; a contiguous (N, 3, H, W) batch wants planes. numpy's and torch's
 *   strided copies move ~3 GB/s (60 us for a 250x250 image, a quarter of its decode); this loop,
 *   vectorised with SSSE3 shuffles where the CPU has them, ~9 us (measured). GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <limits.h>
#include <unistd.h>
#include <jpeglib.h>
/* XXH3-64 (seed 0), the sample index's digest of a sample's bytes (FORMAT.md): the xxHash library
 * itself (its header, vendored from the xxhash sdist, BSD-2-Clause), compiled in here so tar_at
 * checks each sample in the pass that parses it, with no Python call a sample. On x86-64 through
 * xxHash's own runtime dispatch (xxh_x86dispatch.c, as the xxhash wheel is built): AVX2 where the
 * CPU has it hashes a 5.6 kB sample in ~1.6k instructions against SSE2's ~4.7k (valgrind). */
#if defined(__x86_64__) && defined(__GNUC__)
#include "xxh_x86dispatch.c"
#define sample_xxh3 XXH3_64bits_dispatch
#else
#define XXH_INLINE_ALL
#include "xxhash.h"
#define sample_xxh3 XXH3_64bits
#endif

struct roi_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void roi_error_exit(j_common_ptr cinfo)
{
    struct roi_error *err = (struct roi_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* A warning means corrupt data (libjpeg would go on with grey pixels): treat it as an error so
 * the caller's fallback decides, as it does for simplejpeg's strict mode. */
static void roi_emit_message(j_common_ptr cinfo, int msg_level)
{
    if (msg_level < 0)
        roi_error_exit(cinfo);
}

static PyObject *roi_decode(PyObject *self, PyObject *args)
{
    Py_buffer src;
    int denom, top, left, height, width, fast = 0;
    if (!PyArg_ParseTuple(args, "y*iiiii|p", &src, &denom, &top, &left, &height, &width, &fast))
        return NULL;

    struct jpeg_decompress_struct cinfo;
    struct roi_error jerr;
    /* volatile: read after a longjmp back into this frame */
    PyObject *volatile out = NULL;
    volatile int released = 0;
    PyThreadState *volatile ts = NULL;

    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = jpeg_std_error(&jerr.pub);
    jerr.pub.error_exit = roi_error_exit;
    jerr.pub.emit_message = roi_emit_message;
    jerr.message[0] = 0;
    if (setjmp(jerr.jump)) {
        if (released)
            PyEval_RestoreThread(ts);
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&src);
        Py_XDECREF(out);
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", jerr.message);
        return NULL;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)src.buf, (unsigned long)src.len);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        strcpy(jerr.message, "colour space without an RGB conversion (CMYK/YCCK)");
        longjmp(jerr.jump, 1);
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    /* simplejpeg's defaults (accurate IDCT, fancy upsampling): the same pixels as a full decode;
       fast: libjpeg's fast integer IDCT, as simplejpeg's fastdct=True (FFCV's choice) */
    cinfo.dct_method = fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    if (top < 0 || left < 0 || height <= 0 || width <= 0 ||
        (JDIMENSION)(top + height) > cinfo.output_height ||
        (JDIMENSION)(left + width) > cinfo.output_width) {
        snprintf(jerr.message, sizeof(jerr.message), "region outside the %ux%u scaled image",
                 cinfo.output_width, cinfo.output_height);
        longjmp(jerr.jump, 1);
    }
    /* One more column each side: fancy upsampling at a cropped edge replicates the edge's chroma
     * instead of reading its neighbour, so a crop edge that falls on an iMCU boundary would
     * differ from a full decode; with the margin the edges are interior and the pixels equal. */
    JDIMENSION x0 = (JDIMENSION)(left > 0 ? left - 1 : 0);
    JDIMENSION w = (JDIMENSION)(left + width) - x0;
    if (x0 + w < cinfo.output_width)
        w++;
    if (w < cinfo.output_width)
        jpeg_crop_scanline(&cinfo, &x0, &w); /* widens to iMCU boundaries */
    else
        x0 = 0, w = cinfo.output_width;
    size_t stride = (size_t)cinfo.output_width * 3; /* output_width is w after the crop */
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(stride * (size_t)height));
    if (!out) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&src);
        return NULL;
    }
    unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);
    ts = PyEval_SaveThread();
    released = 1;
    if (top > 0)
        jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
    JSAMPROW rows[16];
    while (cinfo.output_scanline < (JDIMENSION)(top + height)) {
        JDIMENSION done = cinfo.output_scanline - (JDIMENSION)top;
        JDIMENSION n = (JDIMENSION)(top + height) - cinfo.output_scanline;
        if (n > 16)
            n = 16;
        for (JDIMENSION i = 0; i < n; i++)
            rows[i] = pixels + stride * (size_t)(done + i);
        jpeg_read_scanlines(&cinfo, rows, n);
    }
    /* the rows below the crop are never decoded */
    jpeg_abort_decompress(&cinfo);
    released = 0;
    PyEval_RestoreThread(ts);
    unsigned int out_width = cinfo.output_width;
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&src);
    return Py_BuildValue("(NII)", out, (unsigned int)x0, out_width);
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* one build for every x86-64 CPU: the loader picks the AVX2 or SSSE3 clone where the CPU has it
 * (AVX2: 7.3% -> 5.2% of a planar LFW fill loop's profile, ~3.5 us per image; measured) */
__attribute__((target_clones("avx2", "ssse3", "default")))
#endif
/* ``count`` interleaved RGB pixels of ``src`` into three planes ``plane`` bytes apart at ``dst``. */
static void planes(const unsigned char *restrict src, unsigned char *restrict dst, size_t plane,
                   size_t count)
{
    unsigned char *restrict r = dst, *restrict g = dst + plane, *restrict b = dst + 2 * plane;
    for (size_t i = 0; i < count; i++) {
        r[i] = src[3 * i];
        g[i] = src[3 * i + 1];
        b[i] = src[3 * i + 2];
    }
}

/* decode_batch: whole JPEGs of one size into consecutive images of a batch buffer, one call per
 * batch (the loader's fill path for fixed-size images without a crop). Per image, Python would
 * spend ~2 us on the call chain and TurboJPEG a decompressor set up and torn down; here one
 * decompressor serves the batch with the GIL released throughout, and a planar batch gets each
 * 16-row strip transposed while it is still in cache (not a second pass over the image). It stops
 * at the first image it does not take (not a JPEG, another size, CMYK, a warning, an error) and
 * says how many it decoded: the caller sends that one through the ordinary per-image path, which
 * decides (fallback decoder, the sample's own error), so this path never changes an outcome. */
static int batch_one(struct jpeg_decompress_struct *cinfo, struct roi_error *jerr,
                     const unsigned char *data, size_t len, unsigned char *dst,
                     unsigned char *strip, JDIMENSION height, JDIMENSION width, int planar,
                     int fast)
{
    if (setjmp(jerr->jump)) {
        jpeg_abort_decompress(cinfo);
        return 0;
    }
    if (len < 3 || data[0] != 0xFF || data[1] != 0xD8 || data[2] != 0xFF)
        return 0;
    jpeg_mem_src(cinfo, data, (unsigned long)len);
    jpeg_read_header(cinfo, TRUE);
    if ((cinfo->jpeg_color_space != JCS_YCbCr && cinfo->jpeg_color_space != JCS_GRAYSCALE &&
         cinfo->jpeg_color_space != JCS_RGB) ||
        cinfo->image_height != height || cinfo->image_width != width) {
        jpeg_abort_decompress(cinfo);
        return 0;
    }
    cinfo->out_color_space = JCS_RGB;
    cinfo->scale_num = cinfo->scale_denom = 1;
    cinfo->dct_method = fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo->do_fancy_upsampling = TRUE;
    jpeg_start_decompress(cinfo);
    size_t stride = (size_t)width * 3, plane = (size_t)height * width;
    JSAMPROW rows[16];
    while (cinfo->output_scanline < height) {
        JDIMENSION y = cinfo->output_scanline, n = height - y;
        if (n > 16)
            n = 16;
        for (JDIMENSION i = 0; i < n; i++)
            rows[i] = planar ? strip + stride * i : dst + stride * (size_t)(y + i);
        JDIMENSION got = 0;
        while (got < n) /* a strip in one or more reads (libjpeg returns an iMCU row at most) */
            got += jpeg_read_scanlines(cinfo, rows + got, n - got);
        if (planar)
            planes(strip, dst + (size_t)y * width, plane, (size_t)n * width);
    }
    jpeg_finish_decompress(cinfo);
    return 1;
}

static int batch_start(struct jpeg_decompress_struct *cinfo, struct roi_error *jerr)
{
    if (setjmp(jerr->jump))
        return 0; /* out of memory: every image goes the per-image way */
    jpeg_create_decompress(cinfo);
    return 1;
}

static PyObject *decode_batch(PyObject *self, PyObject *args)
{
    PyObject *datas;
    Py_buffer dst;
    Py_ssize_t first;
    int height, width, planar, fast;
    if (!PyArg_ParseTuple(args, "O!w*niipp", &PyList_Type, &datas, &dst, &first, &height,
                          &width, &planar, &fast))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(datas);
    size_t image = (size_t)height * (size_t)width * 3;
    if (height <= 0 || width <= 0 || first < 0 || !PyBuffer_IsContiguous(&dst, 'C') ||
        (size_t)dst.len < image * (size_t)(first + n)) {
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError,
                        "decode_batch: a C-contiguous buffer of (first + len(datas)) images");
        return NULL;
    }
    const unsigned char **bufs = PyMem_Malloc(sizeof(*bufs) * (size_t)(n ? n : 1));
    size_t *lens = PyMem_Malloc(sizeof(*lens) * (size_t)(n ? n : 1));
    unsigned char *strip = PyMem_Malloc((size_t)width * 3 * 16);
    PyObject *items = PyList_GetSlice(datas, 0, n); /* owned: the list may change, not these */
    if (!bufs || !lens || !strip || !items) {
        PyMem_Free(bufs), PyMem_Free(lens), PyMem_Free(strip), Py_XDECREF(items);
        PyBuffer_Release(&dst);
        return PyErr_NoMemory();
    }
    Py_ssize_t usable = 0;
    for (; usable < n; usable++) { /* bytes only; anything else goes the per-image way */
        PyObject *item = PyList_GET_ITEM(items, usable);
        if (!PyBytes_Check(item))
            break;
        bufs[usable] = (const unsigned char *)PyBytes_AS_STRING(item);
        lens[usable] = (size_t)PyBytes_GET_SIZE(item);
    }
    struct jpeg_decompress_struct cinfo;
    struct roi_error jerr;
    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = jpeg_std_error(&jerr.pub);
    jerr.pub.error_exit = roi_error_exit;
    jerr.pub.emit_message = roi_emit_message;
    Py_ssize_t done = 0;
    unsigned char *out = (unsigned char *)dst.buf + image * (size_t)first;
    Py_BEGIN_ALLOW_THREADS
    if (batch_start(&cinfo, &jerr)) {
        while (done < usable && batch_one(&cinfo, &jerr, bufs[done], lens[done],
                                          out + image * (size_t)done, strip, (JDIMENSION)height,
                                          (JDIMENSION)width, planar, fast))
            done++;
        jpeg_destroy_decompress(&cinfo);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(bufs), PyMem_Free(lens), PyMem_Free(strip);
    Py_DECREF(items);
    PyBuffer_Release(&dst);
    return PyLong_FromSsize_t(done);
}

static PyObject *hwc_to_chw(PyObject *self, PyObject *args)
{
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst))
        return NULL;
    if (src.len != dst.len || src.len % 3 != 0 || !PyBuffer_IsContiguous(&src, 'C') ||
        !PyBuffer_IsContiguous(&dst, 'C')) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "hwc_to_chw: two C-contiguous buffers of 3*H*W bytes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    planes((const unsigned char *)src.buf, (unsigned char *)dst.buf, (size_t)src.len / 3,
           (size_t)src.len / 3);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

/* tar_samples: the common run of a tar shard's samples parsed in C (the reader's hot loop, where
 * per-member Python cost ~2 us, a quarter of a small image's overhead). From ``pos``, a header that
 * starts a sample, it takes whole samples made only of plain members: ustar file headers without
 * a prefix, ``key.ext`` names (ext lower case, no dot, not a ``_`` meta name), octal sizes, data in
 * the window, no extension twice, decimal labels. A sample is taken once the next plain header
 * shows another key. At anything else it stops before that sample and returns where: the Python
 * parser continues from there with its full rules and errors, so this never changes an outcome.
 * Returns (records, pos, done): Records of samples ``start <= n < stop`` built by calling ``make``
 * (key, ext, data, label, shard, fields or None), the header where it stopped, and the samples
 * counted. ``fields``: the extensions whose members a Record carries (``{ext: bytes}``). It
 * returns once ``budget`` bytes of images are taken: a window's worth of records alive at once,
 * freed together, makes glibc trim and re-fault the heap (measured: 7 us per LFW sample, 2 us
 * with a 64 KB budget). ``bits`` (a split's, with ``base``, ``salt`` and ``threshold``: on_side):
 * each sample it makes is taken only on the side its own key's hash puts it; one that is not
 * stops it there, and the Python parser names that sample. ``digests`` (with ``offsets`` and
 * ``origin``: a partial read's, from the shard's sample index: each sample's XXH3-64, native
 * order, the N + 1 sample offsets as native 64-bit ints, and the shard's byte at ``buf[0]``): each
 * sample it makes is taken only where its bytes are exactly the index's range of it and hash to
 * its digest; anything else stops it before that sample, and the Python parser checks it. */
#define TAR_BLOCK 512
#define TAR_MAX_MEMBERS 16

struct tar_member {
    Py_ssize_t data, size; /* offset of the data in the window, its length */
    const char *ext;
    Py_ssize_t ext_len;
};

/* A plain member's header at ``h``: its key (offset and length within the name), extension and
 * size; 0 for anything the Python parser must see. */
static int tar_plain(const unsigned char *h, Py_ssize_t *key_len, const char **ext,
                     Py_ssize_t *ext_len, Py_ssize_t *size)
{
    if (memcmp(h + 257, "ustar", 5) != 0 || h[345] != 0 || h[0] == '_' ||
        (h[156] != '0' && h[156] != 0 && h[156] != '7'))
        return 0;
    Py_ssize_t n = 0, slash = 0, dot = -1;
    for (; n < 100 && h[n]; n++) {
        if (h[n] == '\n')
            return 0;
        if (h[n] == '/')
            slash = n + 1, dot = -1;
        else if (h[n] == '.' && dot < 0)
            dot = n;
    }
    if (dot <= slash)
        return 0;
    for (Py_ssize_t i = dot + 1; i < n; i++)
        if (h[i] == '.' || (h[i] >= 'A' && h[i] <= 'Z'))
            return 0;
    /* octal size: leading spaces, digits, then NULs or spaces to the end of the field */
    Py_ssize_t i = 124, v = 0, digits = 0;
    while (i < 135 && h[i] == ' ')
        i++;
    for (; i < 135 && h[i] >= '0' && h[i] <= '7'; i++, digits++)
        v = v * 8 + (h[i] - '0');
    for (; i < 136; i++)
        if (h[i] != 0 && h[i] != ' ')
            return 0;
    if (!digits)
        return 0;
    *key_len = dot, *ext = (const char *)h + dot + 1, *ext_len = n - dot - 1, *size = v;
    return 1;
}

/* A label as int() reads the common case: optional spaces, sign, up to 18 digits, spaces. */
static int tar_label(const unsigned char *p, Py_ssize_t n, long long *out)
{
    Py_ssize_t i = 0;
    while (i < n && (p[i] == ' ' || (p[i] >= '\t' && p[i] <= '\r')))
        i++;
    int neg = 0;
    if (i < n && (p[i] == '-' || p[i] == '+'))
        neg = p[i++] == '-';
    long long v = 0;
    Py_ssize_t digits = 0;
    for (; i < n && p[i] >= '0' && p[i] <= '9' && digits < 18; i++, digits++)
        v = v * 10 + (p[i] - '0');
    while (i < n && (p[i] == ' ' || (p[i] >= '\t' && p[i] <= '\r')))
        i++;
    if (!digits || i != n)
        return 0;
    *out = neg ? -v : v;
    return 1;
}

static int tar_in(PyObject *set, const char *s, Py_ssize_t n)
{
    PyObject *b = PyBytes_FromStringAndSize(s, n);
    if (!b)
        return -1;
    int r = PySet_Contains(set, b);
    Py_DECREF(b);
    return r;
}

/* The sample's members asked for by extension, {ext: bytes}, in member order (as the Python
 * parser builds ``Record.fields``; the image and label members too when asked for). */
static PyObject *tar_fields(const unsigned char *buf, const struct tar_member *m, int count,
                            PyObject *fields)
{
    PyObject *out = PyDict_New();
    for (int j = 0; out && j < count; j++) {
        int r = tar_in(fields, m[j].ext, m[j].ext_len);
        if (r == 0)
            continue;
        PyObject *key = r < 0 ? NULL
                              : PyUnicode_DecodeUTF8(m[j].ext, m[j].ext_len, "surrogateescape");
        PyObject *data =
            key ? PyBytes_FromStringAndSize((const char *)buf + m[j].data, m[j].size) : NULL;
        if (!data || PyDict_SetItem(out, key, data) < 0)
            Py_CLEAR(out);
        Py_XDECREF(key), Py_XDECREF(data);
    }
    return out;
}

/* The Record of a sample parsed into its ``count`` members ``m`` (its key: ``key_len`` bytes at
 * ``key``): 1 with ``*rec`` set (when ``build``; else only classified), 0 when it holds no image
 * (not a sample), 2 when its label is not a plain decimal (the Python parser reads it, or names the
 * bad label), -1 on an error. ``last_ext``: the previous sample's extension object, reused when
 * equal (most samples of a shard share it). */
static int tar_make(const unsigned char *buf, const struct tar_member *m, int count,
                    const unsigned char *key, Py_ssize_t key_len, PyObject *images,
                    PyObject *labels, PyObject *fields, PyObject *make, PyObject *shard,
                    PyObject **last_ext, int build, PyObject **rec, Py_ssize_t *taken)
{
    int image = -1, label = -1;
    for (int j = 0; j < count; j++) {
        if (image < 0) {
            int r = tar_in(images, m[j].ext, m[j].ext_len);
            if (r < 0)
                return -1;
            if (r) {
                image = j;
                continue;
            }
        }
        if (label < 0) {
            int r = tar_in(labels, m[j].ext, m[j].ext_len);
            if (r < 0)
                return -1;
            if (r)
                label = j;
        }
    }
    if (image < 0)
        return 0;
    if (!build)
        return 1;
    long long value = -1;
    if (label >= 0 && !tar_label(buf + m[label].data, m[label].size, &value))
        return 2;
    PyObject *k = PyUnicode_DecodeUTF8((const char *)key, key_len, "surrogateescape");
    PyObject *e = NULL, *last = *last_ext;
    if (last && PyUnicode_GET_LENGTH(last) == m[image].ext_len &&
        memcmp(PyUnicode_DATA(last), m[image].ext, (size_t)m[image].ext_len) == 0 &&
        PyUnicode_KIND(last) == PyUnicode_1BYTE_KIND && PyUnicode_IS_ASCII(last)) {
        e = last;
        Py_INCREF(e);
    } else {
        e = PyUnicode_DecodeUTF8(m[image].ext, m[image].ext_len, "surrogateescape");
        if (e) {
            Py_XDECREF(last);
            *last_ext = e;
            Py_INCREF(e);
        }
    }
    PyObject *d = PyBytes_FromStringAndSize((const char *)buf + m[image].data, m[image].size);
    PyObject *l = PyLong_FromLongLong(value);
    PyObject *x = PySet_GET_SIZE(fields) > 0 ? tar_fields(buf, m, count, fields)
                                             : Py_NewRef(Py_None);
    *rec = NULL;
    if (k && e && d && l && x)
        *rec = PyObject_CallFunctionObjArgs(make, k, e, d, l, shard, x, NULL);
    Py_XDECREF(k), Py_XDECREF(e), Py_XDECREF(d), Py_XDECREF(l), Py_XDECREF(x);
    if (!*rec)
        return -1;
    *taken += m[image].size;
    return 1;
}

/* The split hash of a key as the sample index stores it: the first 8 bytes of BLAKE2b-64 (RFC 7693,
 * digest length 8, no key) of ``salt`` followed by the key's bytes, in the digest's byte order.
 * tar_at checks each sample it parses against its index with it, tar_samples each sample a split
 * streams against its side; a wrong answer here could only send a sample to the Python reader and
 * its own check (hashlib's), never pass another sample. */
static const uint64_t b2_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t b2_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

#define B2_ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define B2_G(a, b, c, d, x, y)                                                                      \
    do {                                                                                           \
        v[a] = v[a] + v[b] + (x), v[d] = B2_ROTR(v[d] ^ v[a], 32);                                 \
        v[c] = v[c] + v[d], v[b] = B2_ROTR(v[b] ^ v[c], 24);                                       \
        v[a] = v[a] + v[b] + (y), v[d] = B2_ROTR(v[d] ^ v[a], 16);                                 \
        v[c] = v[c] + v[d], v[b] = B2_ROTR(v[b] ^ v[c], 63);                                       \
    } while (0)

static void b2_compress(uint64_t h[8], const unsigned char *block, uint64_t t, int last)
{
    uint64_t v[16], m[16];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(m, block, sizeof m); /* the words are little-endian: as they lie */
#else
    for (int i = 0; i < 16; i++) {
        uint64_t w = 0;
        for (int j = 7; j >= 0; j--)
            w = (w << 8) | block[8 * i + j];
        m[i] = w;
    }
#endif
    for (int i = 0; i < 8; i++)
        v[i] = h[i], v[i + 8] = b2_iv[i];
    v[12] ^= t;
    if (last)
        v[14] = ~v[14];
#pragma GCC unroll 12 /* the rounds unrolled, their message indices constants: 180 -> 130 ns */
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = b2_sigma[r];
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* The 8 digest bytes of BLAKE2b-64(salt + key) into ``out``. */
static void split_hash(const unsigned char *salt, Py_ssize_t salt_len, const unsigned char *key,
                       Py_ssize_t key_len, unsigned char out[8])
{
    uint64_t h[8];
    for (int i = 0; i < 8; i++)
        h[i] = b2_iv[i];
    h[0] ^= 0x01010000ULL ^ 8; /* fanout 1, depth 1, no key, digest length 8 */
    Py_ssize_t total = salt_len + key_len, done = 0;
    unsigned char block[128];
    do {
        Py_ssize_t n = total - done < 128 ? total - done : 128, a = 0;
        if (done < salt_len) { /* the salt's part of this block, then the key's */
            a = salt_len - done < n ? salt_len - done : n;
            memcpy(block, salt + done, (size_t)a);
        }
        memcpy(block + a, key + (done + a - salt_len), (size_t)(n - a));
        memset(block + n, 0, (size_t)(128 - n));
        done += n;
        b2_compress(h, block, (uint64_t)done, done == total);
    } while (done < total);
    for (int j = 0; j < 8; j++)
        out[j] = (unsigned char)(h[0] >> (8 * j));
}

/* Whether sample ``n`` of a shard (its key: ``key_len`` bytes at ``key``) lies on the side a split
 * put it: its key's split hash is below ``threshold`` exactly where bit ``base + n`` of ``bits``
 * (np.packbits of every sample's "is val", the most significant bit first) is set. */
static int on_side(const Py_buffer *bits, Py_ssize_t base, const Py_buffer *salt,
                   unsigned long long threshold, Py_ssize_t n, const unsigned char *key,
                   Py_ssize_t key_len)
{
    Py_ssize_t p = base + n;
    if (p < 0 || (p >> 3) >= bits->len)
        return 0; /* outside the bits: the Python parser names it */
    int val = (((const unsigned char *)bits->buf)[p >> 3] >> (7 - (p & 7))) & 1;
    unsigned char d[8];
    split_hash(salt->buf, salt->len, key, key_len, d);
    unsigned long long h = 0;
    for (int j = 0; j < 8; j++)
        h = (h << 8) | d[j]; /* big-endian, as the index stores and compares it */
    return (h < threshold) == val;
}

/* Whether sample ``n``, the bytes ``[group, pos)`` of ``buf`` (the shard's byte ``origin`` at
 * ``buf[0]``), is exactly the range its index gives it and hashes to its index's digest. */
static int tar_digest_ok(const Py_buffer *dv, const Py_buffer *ov, long long origin,
                         const unsigned char *buf, Py_ssize_t group, Py_ssize_t pos, Py_ssize_t n)
{
    uint64_t want;
    long long lo, hi;
    if (n < 0 || n >= dv->len / 8 || n + 1 >= ov->len / 8)
        return 0;
    memcpy(&want, (const unsigned char *)dv->buf + 8 * n, 8);
    memcpy(&lo, (const unsigned char *)ov->buf + 8 * n, 8);
    memcpy(&hi, (const unsigned char *)ov->buf + 8 * (n + 1), 8);
    return lo == origin + group && hi == origin + pos &&
           sample_xxh3(buf + group, (size_t)(pos - group)) == want;
}

static PyObject *tar_samples(PyObject *self, PyObject *args)
{
    Py_buffer view, bits = {0}, salt = {0}, dv = {0}, ov = {0};
    PyObject *out = NULL, *last_ext = NULL; /* last_ext: the previous sample's extension, reused */
    PyObject *result = NULL;
    Py_ssize_t pos, end, done, start, stop, budget, taken = 0, base = 0;
    unsigned long long threshold = 0;
    long long origin = 0;
    PyObject *images, *labels, *fields, *make, *shard;
    if (!PyArg_ParseTuple(args, "y*nnnnnnO!O!O!OO|y*ny*Ky*y*L", &view, &pos, &end, &done, &start,
                          &stop, &budget, &PyFrozenSet_Type, &images, &PyFrozenSet_Type, &labels,
                          &PyFrozenSet_Type, &fields, &make, &shard, &bits, &base, &salt,
                          &threshold, &dv, &ov, &origin))
        return NULL;
    const unsigned char *buf = view.buf;
    int sides = bits.buf != NULL && bits.len > 0 && salt.buf != NULL;
    int digests = dv.buf != NULL && ov.buf != NULL;
    if (pos < 0 || end > view.len || pos > end) {
        PyErr_SetString(PyExc_ValueError, "tar_samples: pos and end outside the buffer");
        goto fail;
    }
    out = PyList_New(0);
    if (!out)
        goto fail;
    while ((stop < 0 || done < stop) && taken < budget) {
        Py_ssize_t group = pos, key_len, ext_len, size;
        const char *ext;
        if (pos + TAR_BLOCK > end || !tar_plain(buf + pos, &key_len, &ext, &ext_len, &size))
            break;
        const unsigned char *key = buf + pos;
        struct tar_member m[TAR_MAX_MEMBERS];
        int count = 0, closed = 0, odd = 0;
        while (!odd) { /* the members of this sample, up to the next key's header */
            if (count == TAR_MAX_MEMBERS)
                odd = 1;
            Py_ssize_t padded = (size + TAR_BLOCK - 1) / TAR_BLOCK * TAR_BLOCK;
            if (odd || size > end - pos - TAR_BLOCK || padded > end - pos - TAR_BLOCK) {
                odd = 1;
                break;
            }
            for (int j = 0; j < count; j++)
                if (m[j].ext_len == ext_len && memcmp(m[j].ext, ext, (size_t)ext_len) == 0)
                    odd = 1; /* a duplicate: the Python parser names it */
            m[count].data = pos + TAR_BLOCK, m[count].size = size;
            m[count].ext = ext, m[count].ext_len = ext_len;
            count++;
            pos += TAR_BLOCK + padded;
            Py_ssize_t klen;
            if (pos + TAR_BLOCK > end || !tar_plain(buf + pos, &klen, &ext, &ext_len, &size))
                break; /* not closed by a plain header: the Python parser takes it */
            if (klen != key_len || memcmp(buf + pos, key, (size_t)key_len) != 0) {
                closed = 1;
                break;
            }
        }
        if (odd || !closed) {
            pos = group;
            break;
        }
        PyObject *rec = NULL;
        int made = tar_make(buf, m, count, key, key_len, images, labels, fields, make, shard,
                            &last_ext, done >= start, &rec, &taken);
        if (made < 0)
            goto fail;
        if (made == 0) /* no image: not a sample (not counted) */
            continue;
        if (made == 2) {
            pos = group; /* the Python parser reads it, or names the bad label */
            break;
        }
        if (rec && sides && !on_side(&bits, base, &salt, threshold, done, key, key_len)) {
            Py_DECREF(rec); /* on the other side by its key: the Python parser names it */
            pos = group;
            break;
        }
        if (rec && digests && !tar_digest_ok(&dv, &ov, origin, buf, group, pos, done)) {
            Py_DECREF(rec); /* not the bytes its index hashed: the Python parser checks it */
            pos = group;
            break;
        }
        if (rec) {
            int r = PyList_Append(out, rec);
            Py_DECREF(rec);
            if (r < 0)
                goto fail;
        }
        done++;
    }
    result = Py_BuildValue("(Nnn)", out, pos, done); /* "N": out is the tuple's (or freed) */
    out = NULL;
fail: /* and the end of a success: one release of everything held */
    Py_XDECREF(last_ext);
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    if (bits.buf)
        PyBuffer_Release(&bits);
    if (salt.buf)
        PyBuffer_Release(&salt);
    if (dv.buf)
        PyBuffer_Release(&dv);
    if (ov.buf)
        PyBuffer_Release(&ov);
    return result;
}

/* split_hashes: the split hash of each key of a key table (``table``: the keys' bytes laid end to
 * end, ``ends``: where each ends, native 64-bit ints, ascending), with ``salt``: 8 bytes a key, as
 * the index stores them (big-endian). What checks a stored hash column against its keys when a
 * dataset grows (hashlib's cost, ~0.5 us a key in Python, is 4x this). */
static PyObject *split_hashes(PyObject *self, PyObject *args)
{
    Py_buffer tv, ev, salt;
    if (!PyArg_ParseTuple(args, "y*y*y*", &tv, &ev, &salt))
        return NULL;
    Py_ssize_t n = ev.len / (Py_ssize_t)sizeof(long long);
    const long long *ends = ev.buf;
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long lo = i ? ends[i - 1] : 0;
        if (lo < 0 || ends[i] < lo || ends[i] > tv.len) {
            PyErr_SetString(PyExc_ValueError, "split_hashes: ends out of order or past the table");
            goto done;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (out) {
        unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
        const unsigned char *t = tv.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            long long lo = i ? ends[i - 1] : 0;
            split_hash(salt.buf, salt.len, t + lo, (Py_ssize_t)(ends[i] - lo), o + 8 * i);
        }
        Py_END_ALLOW_THREADS
    }
done:
    PyBuffer_Release(&tv);
    PyBuffer_Release(&ev);
    PyBuffer_Release(&salt);
    return out;
}

/* tar_at: the samples a sample index places in ``buf`` at ``[starts[i], ends[i])`` (two buffers of
 * native 64-bit ints, e.g. numpy int64 arrays), each parsed as tar_samples parses a plain sample:
 * the read of a subset or split, where the wanted samples lie apart (runs of one or two in a 10%
 * split) and one call per run cost more Python than the parse. A sample is taken when its members
 * are plain, share its key, end exactly at ``ends[i]``, and the header there (which ``buf`` must
 * hold) is a plain one of another key or the end-of-archive block, and (``hashes`` not empty: 8
 * bytes a sample, the index's key hashes as stored, big-endian) its key's split_hash with ``salt``
 * is the index's. Returns a list of one Record or None per sample: None where anything else is
 * found (the Python parser takes that sample, with its rules, errors and key check), so this never
 * changes an outcome. With ``digests`` (optional, 8 bytes a sample: the index's XXH3-64 digests,
 * native order), each sample's bytes ``[starts[i], ends[i])`` are hashed just before it is parsed
 * (still in cache) and the first one that differs ends the call: its number ``i`` is returned
 * instead of the list (a range ``buf`` does not hold differs too), and no record is handed out. */
static PyObject *tar_at(PyObject *self, PyObject *args)
{
    Py_buffer view, sv, ev, hv, salt, dv = {0};
    PyObject *images, *labels, *fields, *make, *shard;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*O!O!O!OO|y*", &view, &sv, &ev, &hv, &salt,
                          &PyFrozenSet_Type, &images, &PyFrozenSet_Type, &labels,
                          &PyFrozenSet_Type, &fields, &make, &shard, &dv))
        return NULL;
    PyObject *out = NULL, *last_ext = NULL;
    Py_ssize_t taken = 0; /* not used: a run's records are few */
    if (sv.len != ev.len || sv.len % (Py_ssize_t)sizeof(long long) != 0 ||
        (hv.len && hv.len != sv.len) || (dv.len && dv.len != sv.len)) {
        PyErr_SetString(PyExc_ValueError,
                        "tar_at: starts, ends, hashes and digests differ in length");
        goto done;
    }
    const unsigned char *hashes = hv.buf;
    Py_ssize_t n = sv.len / (Py_ssize_t)sizeof(long long), len = view.len;
    const long long *starts = sv.buf, *ends = ev.buf;
    const unsigned char *buf = view.buf;
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        long long pos = starts[i], stop = ends[i];
        if (dv.len) { /* the sample's bytes are the packer's, or nothing of it is handed out */
            uint64_t want;
            memcpy(&want, (const unsigned char *)dv.buf + 8 * i, 8);
            if (pos < 0 || pos > stop || stop > len ||
                sample_xxh3(buf + pos, (size_t)(stop - pos)) != want) {
                Py_DECREF(out);
                out = PyLong_FromSsize_t(i);
                goto done;
            }
        }
        PyObject *rec = NULL;
        Py_ssize_t key_len, ext_len, size, klen;
        const char *ext;
        struct tar_member m[TAR_MAX_MEMBERS];
        int count = 0, ok = 0;
        if (pos >= 0 && pos < stop && stop <= len - TAR_BLOCK &&
            tar_plain(buf + pos, &key_len, &ext, &ext_len, &size)) {
            const unsigned char *key = buf + pos;
            for (;;) { /* the members, up to the sample's end */
                Py_ssize_t padded = (size + TAR_BLOCK - 1) / TAR_BLOCK * TAR_BLOCK;
                if (count == TAR_MAX_MEMBERS || size > stop - pos - TAR_BLOCK ||
                    padded > stop - pos - TAR_BLOCK)
                    break;
                int twice = 0;
                for (int j = 0; j < count; j++)
                    if (m[j].ext_len == ext_len && memcmp(m[j].ext, ext, (size_t)ext_len) == 0)
                        twice = 1; /* a duplicate: the Python parser names it */
                if (twice)
                    break;
                m[count].data = pos + TAR_BLOCK, m[count].size = size;
                m[count].ext = ext, m[count].ext_len = ext_len;
                count++;
                pos += TAR_BLOCK + padded;
                const unsigned char *h = buf + pos;
                if (!tar_plain(h, &klen, &ext, &ext_len, &size)) {
                    /* past the sample's end: the end of the archive closes it too */
                    ok = pos == stop && h[0] == 0 && memcmp(h, h + 1, TAR_BLOCK - 1) == 0;
                    break;
                }
                int same = klen == key_len && memcmp(h, key, (size_t)key_len) == 0;
                if (pos == stop) {
                    ok = !same; /* closed by another key's header */
                    break;
                }
                if (!same)
                    break; /* another key before the end the index says */
            }
            if (ok && hv.len) { /* the key's hash as its index stores it, or not taken here */
                unsigned char digest[8];
                split_hash(salt.buf, salt.len, key, key_len, digest);
                ok = memcmp(digest, hashes + 8 * i, 8) == 0;
            }
            if (ok) {
                int made = tar_make(buf, m, count, key, key_len, images, labels, fields, make,
                                    shard, &last_ext, 1, &rec, &taken);
                if (made < 0)
                    Py_CLEAR(out);
            }
        }
        if (out)
            PyList_SET_ITEM(out, i, rec ? rec : Py_NewRef(Py_None));
    }
done:
    Py_XDECREF(last_ext);
    PyBuffer_Release(&view);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&ev);
    PyBuffer_Release(&hv);
    PyBuffer_Release(&salt);
    if (dv.obj)
        PyBuffer_Release(&dv);
    return out;
}

/* The spans [lo[i], hi[i]) of ``fd`` read one after another into ``buf`` from ``*p`` (advanced by
 * the bytes read), one pread a span, again where the kernel gives less, EINTR retried; called
 * with the GIL released. Returns 0, errno where a read fails, or -1 where the file ends before a
 * span (the caller sees fewer bytes). pread_spans and pread_at read through it. */
static int read_spans(int fd, char *buf, const long long *lo, const long long *hi, Py_ssize_t n,
                      Py_ssize_t *p)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        long long at = lo[i], left = hi[i] - lo[i];
        while (left > 0) {
            ssize_t r = pread(fd, buf + *p, (size_t)left, (off_t)at);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                return errno;
            if (r == 0)
                return -1;
            *p += r, at += r, left -= r;
        }
    }
    return 0;
}

/* pread_spans(fd, buf, lo, hi): the bytes ``[lo[i], hi[i])`` of the open file ``fd`` laid end to
 * end from the start of ``buf`` (writable; ``lo`` and ``hi``: native 64-bit ints), one pread a span
 * (again where the kernel gives less, EINTR retried), the GIL released: a sparse epoch's spans are
 * mostly one sample each, and one os.preadv call a span from Python cost more than the parse of
 * its sample. Returns the bytes read: fewer than the spans hold where the file ends first (the
 * caller names the shard); OSError where a read fails. */
static PyObject *pread_spans(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer bv, lv, hv;
    if (!PyArg_ParseTuple(args, "iw*y*y*", &fd, &bv, &lv, &hv))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = lv.len / (Py_ssize_t)sizeof(long long), total = 0, p = 0;
    const long long *lo = lv.buf, *hi = hv.buf;
    int err = 0;
    if (lv.len != hv.len || lv.len % (Py_ssize_t)sizeof(long long) != 0) {
        PyErr_SetString(PyExc_ValueError, "pread_spans: lo and hi differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lo[i] < 0 || hi[i] < lo[i] || hi[i] - lo[i] > bv.len - total) {
            PyErr_SetString(PyExc_ValueError, "pread_spans: a span out of order or past the buffer");
            goto done;
        }
        total += (Py_ssize_t)(hi[i] - lo[i]);
    }
    Py_BEGIN_ALLOW_THREADS
    err = read_spans(fd, bv.buf, lo, hi, n, &p);
    Py_END_ALLOW_THREADS
    if (err > 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t(p);
done:
    PyBuffer_Release(&bv);
    PyBuffer_Release(&lv);
    PyBuffer_Release(&hv);
    return result;
}

/* pread_at(fd, buf, offsets, pos, first, chunk, block, batch, batch_bytes): a local shard's
 * wanted samples ``pos[first:]`` (native 64-bit ints, ascending: sample numbers whose bytes are
 * ``[offsets[p], offsets[p + 1])``) read in one call, as stream.ranges' Python did a shard with
 * some twenty numpy calls: adjacent samples share a span, each span read with the block after it
 * (the header that closes its last sample for tar_at), spans taken while their bytes stay within
 * ``chunk`` (at least one), one pread a span into ``buf`` laid end to end (pread_spans' loop, the
 * GIL released). Returns (stop, starts, ends, spans, cuts): the samples ``pos[first:stop]`` read,
 * their places in ``buf`` (bytes of native 64-bit ints, for tar_at), the preads made, and where
 * each parse call's samples begin (relative to ``first``, then the chunk's end: at most ``batch``
 * a call; where a sample is larger than ``batch_bytes / batch``, also a call ending past each
 * ``batch_bytes``: stream.ranges._batches' rule). The bytes the spans need where ``buf`` is
 * smaller (nothing read: the caller grows it and asks again); None where the file ends before a
 * span (the caller names the shard); ValueError where ``pos`` or ``offsets`` place a sample
 * outside the index or out of order (every bound checked before a byte is read); OSError where a
 * read fails. */
static PyObject *pread_at(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer bv, ov, pv;
    Py_ssize_t first, chunk, batch, batch_bytes;
    long long block;
    if (!PyArg_ParseTuple(args, "iw*y*y*nnLnn", &fd, &bv, &ov, &pv, &first, &chunk, &block,
                          &batch, &batch_bytes))
        return NULL;
    PyObject *result = NULL, *sb = NULL, *eb = NULL, *cuts = NULL;
    long long *lo = NULL, *hi = NULL;
    const long long *off = ov.buf, *pos = pv.buf;
    Py_ssize_t noff = ov.len / (Py_ssize_t)sizeof(long long);
    Py_ssize_t npos = pv.len / (Py_ssize_t)sizeof(long long);
    if (ov.len % (Py_ssize_t)sizeof(long long) || pv.len % (Py_ssize_t)sizeof(long long) ||
        first < 0 || first >= npos || chunk < 0 || batch < 1 || batch_bytes < 1 || block < 0) {
        PyErr_SetString(PyExc_ValueError, "pread_at: bad arguments");
        goto done;
    }
    /* the spans: samples first..stop, their bytes within ``chunk`` (the first span always) */
    Py_ssize_t stop = first, nspans = 0, total = 0, maxsize = 0;
    lo = PyMem_Malloc(sizeof(long long) * (size_t)(npos - first));
    hi = PyMem_Malloc(sizeof(long long) * (size_t)(npos - first));
    sb = PyBytes_FromStringAndSize(NULL, (npos - first) * (Py_ssize_t)sizeof(long long));
    eb = PyBytes_FromStringAndSize(NULL, (npos - first) * (Py_ssize_t)sizeof(long long));
    if (!lo || !hi || !sb || !eb) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    long long *rs = (long long *)PyBytes_AS_STRING(sb), *re = (long long *)PyBytes_AS_STRING(eb);
    long long prev = -1;
    Py_ssize_t i = first;
    while (i < npos) {
        /* one span: a run of adjacent samples from i */
        Py_ssize_t j = i;
        long long a = 0, b = 0;
        for (; j < npos; j++) {
            long long p = pos[j];
            if (p <= prev || p < 0 || p + 1 >= noff || off[p] < 0 || off[p + 1] <= off[p]) {
                PyErr_SetString(PyExc_ValueError,
                                "pread_at: a sample outside its index or out of order");
                goto done;
            }
            if (j > i && off[p] != b)
                break; /* a hole: the next span */
            if (j == i)
                a = off[p];
            b = off[p + 1];
            prev = p;
        }
        if (b > LLONG_MAX - block) {
            PyErr_SetString(PyExc_ValueError, "pread_at: a sample outside its index");
            goto done;
        }
        long long size = b + block - a;
        if (nspans && (long long)total + size > (long long)chunk)
            break; /* not taken: the next call starts here */
        for (Py_ssize_t k = i; k < j; k++) { /* each sample's place in buf */
            long long p = pos[k];
            rs[k - first] = total + off[p] - a;
            re[k - first] = total + off[p + 1] - a;
            if (off[p + 1] - off[p] > maxsize)
                maxsize = (Py_ssize_t)(off[p + 1] - off[p]);
        }
        lo[nspans] = a, hi[nspans] = b + block, nspans++;
        total += (Py_ssize_t)size;
        i = stop = j;
    }
    if (total > bv.len) { /* the caller grows buf to this and asks again */
        result = PyLong_FromSsize_t(total);
        goto done;
    }
    /* the parse calls: as stream.ranges._batches cuts them */
    Py_ssize_t n = stop - first;
    cuts = PyList_New(0);
    if (!cuts)
        goto done;
    long long before = 0, was = 0; /* the samples' bytes before sample k, and before k - 1 */
    int by_count = (long long)maxsize * batch <= (long long)batch_bytes;
    for (Py_ssize_t k = 0; k <= n; k++) {
        int cut = k == 0 || k == n;
        if (k > 0)
            was = before, before += re[k - 1] - rs[k - 1];
        if (!cut && by_count)
            cut = k % batch == 0;
        else if (!cut) /* the bytes before sample k, in whole budgets; or a new count */
            cut = before / batch_bytes != was / batch_bytes || k / batch != (k - 1) / batch;
        if (cut) {
            PyObject *at = PyLong_FromSsize_t(k);
            if (!at || PyList_Append(cuts, at) < 0) {
                Py_XDECREF(at);
                goto done;
            }
            Py_DECREF(at);
        }
    }
    int err = 0;
    Py_ssize_t p = 0;
    Py_BEGIN_ALLOW_THREADS
    err = read_spans(fd, bv.buf, lo, hi, nspans, &p);
    Py_END_ALLOW_THREADS
    if (err > 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (err < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (_PyBytes_Resize(&sb, n * (Py_ssize_t)sizeof(long long)) < 0 ||
        _PyBytes_Resize(&eb, n * (Py_ssize_t)sizeof(long long)) < 0)
        goto done;
    result = Py_BuildValue("nOOnO", stop, sb, eb, nspans, cuts);
done:
    PyMem_Free(lo);
    PyMem_Free(hi);
    Py_XDECREF(sb);
    Py_XDECREF(eb);
    Py_XDECREF(cuts);
    PyBuffer_Release(&bv);
    PyBuffer_Release(&ov);
    PyBuffer_Release(&pv);
    return result;
}

/* xxh3_64(data): the digest tar_at checks, for the test that it is xxhash's own. */
static PyObject *xxh3_64(PyObject *self, PyObject *args)
{
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    uint64_t h = sample_xxh3(data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef roi_methods[] = {
    {"hwc_to_chw", hwc_to_chw, METH_VARARGS, "hwc_to_chw(src, dst): interleaved RGB to planes"},
    {"decode_batch", decode_batch, METH_VARARGS,
     "decode_batch(datas, dst, first, height, width, planar, fast) -> images decoded"},
    {"tar_samples", tar_samples, METH_VARARGS,
     "tar_samples(buf, pos, end, done, start, stop, budget, images, labels, fields, make, shard"
     "[, bits, base, salt, threshold[, digests, offsets, origin]]) -> (records, pos, done)"},
    {"pread_spans", pread_spans, METH_VARARGS,
     "pread_spans(fd, buf, lo, hi) -> bytes read: spans of a file laid end to end in buf"},
    {"pread_at", pread_at, METH_VARARGS,
     "pread_at(fd, buf, offsets, pos, first, chunk, block, batch, batch_bytes) -> "
     "(stop, starts, ends, spans, cuts) or None: a local shard's wanted samples read"},
    {"tar_at", tar_at, METH_VARARGS,
     "tar_at(buf, starts, ends, hashes, salt, images, labels, fields, make, shard[, digests])"
     " -> [record or None], or the first sample whose digest differs"},
    {"xxh3_64", xxh3_64, METH_VARARGS, "xxh3_64(data) -> XXH3-64 of data, seed 0 (tests)"},
    {"split_hashes", split_hashes, METH_VARARGS,
     "split_hashes(table, ends, salt) -> 8 bytes a key: each key's split hash, big-endian"},
    {"decode", roi_decode, METH_VARARGS,
     "decode(data, scale_denom, top, left, height, width, fast=False) -> (bytearray, x0, out_width)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef roi_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Region-of-interest JPEG decoding (libjpeg-turbo scanline API).", -1, roi_methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&roi_module);
}
