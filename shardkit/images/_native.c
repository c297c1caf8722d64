/* Native helpers of the decode path: region-of-interest JPEG decoding through libjpeg-turbo's
 * scanline API (the DALI approach), and the HWC -> CHW transpose of a decoded image.
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
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

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
/* one build for every x86-64 CPU: the loader picks the SSSE3 clone where the CPU has it */
__attribute__((target_clones("ssse3", "default")))
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

static PyMethodDef roi_methods[] = {
    {"hwc_to_chw", hwc_to_chw, METH_VARARGS, "hwc_to_chw(src, dst): interleaved RGB to planes"},
    {"decode_batch", decode_batch, METH_VARARGS,
     "decode_batch(datas, dst, first, height, width, planar, fast) -> images decoded"},
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
