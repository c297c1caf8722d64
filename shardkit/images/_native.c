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
static void planes(const unsigned char *restrict src, unsigned char *restrict dst, size_t n)
{
    unsigned char *restrict r = dst, *restrict g = dst + n, *restrict b = dst + 2 * n;
    for (size_t i = 0; i < n; i++) {
        r[i] = src[3 * i];
        g[i] = src[3 * i + 1];
        b[i] = src[3 * i + 2];
    }
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
    planes((const unsigned char *)src.buf, (unsigned char *)dst.buf, (size_t)src.len / 3);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyMethodDef roi_methods[] = {
    {"hwc_to_chw", hwc_to_chw, METH_VARARGS, "hwc_to_chw(src, dst): interleaved RGB to planes"},
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
