"""Decoding a whole batch in the training process with NVIDIA's nvImageCodec, on its device.

When the CPUs cannot decode as fast as the GPU trains (ResNet-18 on an H100 takes ~12,000 images/s;
16 cores decode ~5,000), ``ShardLoader(decode_on="device")`` has its workers read, shuffle and
choose each sample's crop from the JPEG header as usual, but put the compressed bytes in the ring;
this module decodes the batch where the training runs. nvImageCodec is the library DALI decodes
with: on a GPU it takes nvJPEG's hardware engine where the GPU has one (A100, H100: no CUDA cores
taken from the model), else its CUDA or hybrid backend; without a GPU its CPU backend answers the
same calls, which is how the path is built and tested on machines with no GPU.

Each image is decoded as its crop's region only (``CodeStream.get_sub_code_stream(region=)``, the
same box the CPU path crops: ``geometry.TensorDecoder.crop_box``). What nvImageCodec declines as a
region is decoded whole, still on the device, and its box cut from it; only what it declines
whole (a backend without PNG or CMYK, a damaged header) reaches the CPU decoder, counted
(``ShardLoader.feed_counts``) and warned about once. The crops are then resized, flipped and
normalised as one batch (``resize_batch``: two batched matrix products with torch's antialiased
weights), never one kernel per image.

**Chroma upsampling, measured.** By default the decoder is built with ``:fancy_upsampling=0``
(chroma samples replicated): on an H200's hardware engine region decodes run at 15,300 images/s
against 6,400-7,000 with libjpeg's fancy upsampling, and every nvJPEG accepts them, while
nvImageCodec refuses region decodes with fancy upsampling of chroma-subsampled JPEGs on nvJPEG <
13.2, the version torchvision's wheel carries and the process uses once torchvision is imported
(23 of 256 crops decoded). Its pixel cost: 0.47 levels median per image from the CPU path (0.18
with fancy upsampling), within ``MAX_MEAN_DIFFERENCE``. ``SHARDKIT_DEVICE_UPSAMPLING=fancy``
asks for pixels closest to the CPU path: the first option set whose region decode of a 4:2:0
probe image succeeds (fancy upsampling; fancy on the hardware engine only), else the default.

nvImageCodec is an optional extra (``pip install 'shardkit[gpu-cu13]'`` for CUDA 13 torch,
``shardkit[gpu-cu12]`` for CUDA 12); nothing here imports it until a decoder is built.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import time
from collections.abc import Sequence
from importlib import metadata
from typing import NamedTuple

import numpy as np
import torch

from ..errors import InputError, MissingExtraError
from .geometry import CropBox, resized

__all__ = [
    "MAX_MEAN_DIFFERENCE",
    "Crop",
    "DeviceDecoder",
    "StandInDecoder",
    "aa_weights",
    "nvimgcodec",
    "device_decode_available",
    "place",
    "resize_batch",
]

#: Bound on the mean absolute difference, in 8-bit levels over a batch, between the device path
#: and the CPU path for the same samples and crops. Crops shrunk less than 2x are decoded alike
#: (the same pixels on the CPU backend, up to the float resize's rounding); where the CPU path
#: decodes at a DCT scale, they differ: random-resized crops to 224 of the ImageNet-shaped set
#: (500x375) measured a mean of 0.06 (the worst 1% of images 2.3, the worst 4.5); shrinking those
#: photos to 64 (1/4-1/8 DCT scale) measured 2.8, above this bound. ``:fancy_upsampling=0`` adds
#: 0.81 (median of 64 such photos on the CPU backend; the worst image 2.5).
MAX_MEAN_DIFFERENCE = 1.0

#: Upsampling choices for ``fancy``, in order of preference, the last being ``fast``, the
#: default: (name, nvImageCodec decoder options).
UPSAMPLING = (
    ("fancy", ""),
    ("fancy", "nvjpeg_hw_decoder:enable_roi_fancy_upsampling=1"),
    ("fast", ":fancy_upsampling=0"),
)

#: ``resize_batch`` works on groups of crops padded to their largest: at most this many bytes of
#: padded uint8 pixels at once (a batch of 256 ImageNet crops is one group; huge photos split).
GROUP_BYTES = 256 << 20


@contextlib.contextmanager
def _quiet_stderr():
    """nvImageCodec prints, from C, one error per GPU library it cannot load (nvJPEG, nvTIFF,
    nvJPEG2000) when it is imported or a decoder is built: noise on a machine without them,
    where its CPU backend is what is wanted. Silence file descriptor 2 around those calls."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _nvimgcodec():
    try:
        with _quiet_stderr():
            from nvidia import nvimgcodec
    except ImportError:
        raise MissingExtraError(
            "decode_on='device' decodes with NVIDIA's nvImageCodec: pip install "
            f"'shardkit[{_extra_for(_torch_cuda_major()) or 'gpu'}]'"
        ) from None
    return nvimgcodec


def device_decode_available() -> bool:
    """Whether nvImageCodec can be imported here."""
    try:
        _nvimgcodec()
    except MissingExtraError:
        return False
    return True


# --- versions: which nvImageCodec wheel, which nvJPEG ------------------------------------------


def _torch_cuda_major() -> int | None:
    version = torch.version.cuda
    return int(version.split(".")[0]) if version else None


def _extra_for(cuda_major: int | None) -> str | None:
    return {12: "gpu-cu12", 13: "gpu-cu13"}.get(cuda_major)


def nvimgcodec_cuda_majors() -> list[int]:
    """The CUDA major of each installed nvImageCodec wheel (``nvidia-nvimgcodec-cuNN``)."""
    majors = []
    for major in (11, 12, 13, 14):
        try:
            metadata.version(f"nvidia-nvimgcodec-cu{major}")
        except metadata.PackageNotFoundError:
            continue
        majors.append(major)
    return majors


def check_cuda_match(torch_major: int | None, wheel_majors: Sequence[int]) -> None:
    """A CUDA torch needs the nvImageCodec wheel of its CUDA major: the other one loads no GPU
    backend (or the wrong CUDA runtime). Raised with the extra to install."""
    if torch_major is None or not wheel_majors or torch_major in wheel_majors:
        return
    extra = _extra_for(torch_major) or f"gpu-cu{torch_major}"
    have = ", ".join(f"nvidia-nvimgcodec-cu{m}" for m in wheel_majors)
    raise MissingExtraError(
        f"decode_on='device': torch is built for CUDA {torch_major} but {have} is installed: "
        f"pip install 'shardkit[{extra}]' (and pip uninstall {have.split(', ')[0]})"
    )


def nvjpeg_versions() -> list[tuple[str, str]]:
    """(file, version) of every nvJPEG mapped into this process: torchvision's own copy and
    the ``nvidia-nvjpeg`` wheel's may both be there, and nvImageCodec uses whichever the
    dynamic linker gave it first."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libnvjpeg" in line})
    except OSError:
        return []
    # libnvjpeg.so.13 (the wheel), libnvjpeg.<hash>.so.13 (torchvision's); not nvImageCodec's
    # own libnvjpeg_ext
    paths = [p for p in paths if re.match(r"libnvjpeg([.-][0-9a-f]{6,})?\.so", os.path.basename(p))]
    out = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            parts = []
            for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
                value = ctypes.c_int()
                if lib.nvjpegGetProperty(prop, ctypes.byref(value)) != 0:
                    raise OSError
                parts.append(str(value.value))
            out.append((path, ".".join(parts)))
        except (OSError, AttributeError):
            out.append((path, "unknown"))
    return out


def versions_text() -> str:
    """What decides nvImageCodec's answers here, for a warning."""
    try:
        nv = metadata.version("nvidia-nvimgcodec-cu13")
    except metadata.PackageNotFoundError:
        nv = next(
            (metadata.version(f"nvidia-nvimgcodec-cu{m}") for m in nvimgcodec_cuda_majors()), "?"
        )
    jpegs = ", ".join(f"{v} ({os.path.basename(p)})" for p, v in nvjpeg_versions()) or "none"
    return f"nvImageCodec {nv}, nvJPEG loaded: {jpegs}, torch CUDA {torch.version.cuda}"


# --- decoding ------------------------------------------------------------------------------------


class Crop(NamedTuple):
    """A decoded image (nvImageCodec's, on the device or the host) and the box within it that is
    the sample's crop: the whole of it for a region decode, the crop box where the region was
    declined and the image decoded ``whole``."""

    image: object
    top: int
    left: int
    h: int
    w: int
    whole: bool = False


def _probe_jpeg() -> np.ndarray:
    """A 64x48 4:2:0 JPEG: the kind whose region decodes old nvJPEGs refuse."""
    import simplejpeg

    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)
    data = simplejpeg.encode_jpeg(rgb, quality=90, colorsubsampling="420")
    return np.frombuffer(data, np.uint8)


class DeviceDecoder:
    """Encoded images -> their crops (``Crop``) on ``device`` (None: nvImageCodec's CPU backend).

    On CUDA the backends are tried in the order hardware engine, CUDA, hybrid; on the CPU,
    nvImageCodec's CPU backend. ``backend`` names what was built (``repr(loader)``),
    ``upsampling`` which option set (module docstring)."""

    def __init__(self, device: torch.device | None, upsampling: str | None = None):
        nv = _nvimgcodec()
        self.device = device
        self.cuda = device is not None and device.type == "cuda"
        if self.cuda:
            check_cuda_match(_torch_cuda_major(), nvimgcodec_cuda_majors())
        self._nv = nv
        want = upsampling or os.environ.get("SHARDKIT_DEVICE_UPSAMPLING", "fast")
        if want not in ("fancy", "fast"):
            raise InputError(
                f"SHARDKIT_DEVICE_UPSAMPLING={want!r}: use 'fast' (the default) or 'fancy'"
            )
        choices = list(UPSAMPLING) if want == "fancy" else [UPSAMPLING[-1]]
        kinds = nv.BackendKind
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.index = index
            order = [kinds.HW_GPU_ONLY, kinds.GPU_ONLY, kinds.HYBRID_CPU_GPU]
            where = f"nvImageCodec on cuda:{index} (hardware, CUDA, hybrid)"
        else:
            order = [kinds.CPU_ONLY]
            where = "nvImageCodec CPU backend"
        self.upsampling, self.options = choices[-1][0], choices[-1][1]
        for i, (name, options) in enumerate(choices):
            self.decoder = self._build(order, options)
            last = i == len(choices) - 1
            if last or self._region_works():
                self.upsampling, self.options = name, options
                break
        self.backend = f"{where}, {self.upsampling} upsampling"
        self._copier = _CudaCopier.find() if self.cuda else None

    @property
    def memcpy2d(self) -> bool:
        """Whether the crops reach the batch by one strided CUDA copy (not one per image)."""
        return self._copier is not None

    def _build(self, order, options: str):
        nv = self._nv
        with _quiet_stderr():
            if self.cuda:
                return nv.Decoder(
                    device_id=self.index, backends=[nv.Backend(k) for k in order], options=options
                )
            return nv.Decoder(
                device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                backends=[nv.Backend(k) for k in order],
                options=options,
            )

    def _region_works(self) -> bool:
        data = _probe_jpeg()
        box = CropBox(48, 64, 8, 8, 32, 40, False)
        stream = torch.cuda.Stream(self.device) if self.cuda else None
        try:
            (img,) = self._pass([data], [box], stream)
            if stream is not None:
                stream.synchronize()
        except Exception:  # an option set this nvImageCodec cannot run
            return False
        return img is not None

    def _pass(self, buffers, boxes, stream) -> list:
        """One nvImageCodec call: each buffer's region (its whole image where its box is None),
        None where it was declined or its header is unreadable."""
        nv = self._nv
        streams, where = [], []
        for i, (buf, box) in enumerate(zip(buffers, boxes, strict=True)):
            try:
                cs = nv.CodeStream(buf)
                if box is not None:
                    region = nv.Region(box.top, box.left, box.top + box.h, box.left + box.w)
                    cs = cs.get_sub_code_stream(region=region)
            except Exception:  # an unreadable header: the CPU decoder decides (and names it)
                continue
            streams.append(cs)
            where.append(i)
        out: list = [None] * len(buffers)
        if not streams:
            return out
        with _quiet_stderr():
            if self.cuda:
                images = self.decoder.decode(streams, cuda_stream=stream.cuda_stream)
            else:
                images = self.decoder.decode(streams)
        for i, img in zip(where, images, strict=True):
            out[i] = img
        return out

    def decode(
        self,
        buffers: Sequence[np.ndarray],
        boxes: Sequence[CropBox | None],
        stream: torch.cuda.Stream | None = None,
    ) -> list[Crop | None]:
        """Each buffer's crop (its whole image where its box is None), None where nvImageCodec
        declined it whole. A declined region is decoded whole and its box cut from it. The
        buffers are read in place (they must live until the decode is done: on CUDA, until
        ``stream`` has passed this point), and so must the returned images."""
        images = self._pass(buffers, boxes, stream)
        out: list[Crop | None] = [None] * len(buffers)
        again = []
        for i, (img, box) in enumerate(zip(images, boxes, strict=True)):
            if img is not None:
                h, w = img.shape[:2]
                out[i] = Crop(img, 0, 0, h, w)
            elif box is not None:
                again.append(i)
        if again:
            whole = self._pass([buffers[i] for i in again], [None] * len(again), stream)
            for i, img in zip(again, whole, strict=True):
                if img is not None:
                    b = boxes[i]
                    out[i] = Crop(img, b.top, b.left, b.h, b.w, True)
        return out

    def tensor(self, crop: Crop) -> torch.Tensor:
        """The crop as an (h, w, 3) uint8 tensor (a view of the decoded image)."""
        img = crop.image
        if self.cuda:
            t = torch.as_tensor(img, device=self.device)
        else:
            t = torch.from_numpy(np.asarray(img.cpu()))
        return t[crop.top : crop.top + crop.h, crop.left : crop.left + crop.w]

    def padded(self, crops: Sequence[Crop], target: torch.device) -> torch.Tensor:
        """The crops in one (N, Hmax, Wmax, 3) uint8 batch, each at its top left; the rest is
        left unwritten (``resize_batch`` gives it zero weight). On CUDA one 2-D copy per crop
        on the current stream (``cudaMemcpy2DAsync``: no tensor built per image)."""
        hmax = max(c.h for c in crops)
        wmax = max(c.w for c in crops)
        out = torch.empty((len(crops), hmax, wmax, 3), dtype=torch.uint8, device=target)
        if self._copier is not None:
            self._copier.copy(crops, out)
            return out
        for i, c in enumerate(crops):
            out[i, : c.h, : c.w].copy_(self.tensor(c))
        return out


class StandInDecoder:
    """A stand-in for ``DeviceDecoder`` where there is no GPU (tests, ``bench_device --stub``):
    the same calls the loader's decode threads make (``decode``, ``tensor``, ``padded``), each
    image decoded whole by the CPU decoder and its box cut from it (the CPU path's pixels at
    full scale, as nvImageCodec's region decode), then the thread sleeps ``seconds`` per image:
    a sleep releases the GIL as nvImageCodec's calls do, so the decode threads, lanes, ordering,
    fallbacks and ``"auto"``'s balance run as on a GPU with a known decode time.
    ``stub=True`` decodes and copies nothing (each crop a view of one zero image, the padded
    batch unwritten: wrong pixels), to measure the Python of the decode thread alone. Only
    ever chosen explicitly (``ShardLoader(_decoder_factory=...)``); what fails to decode is
    declined (None), as the real decoder declines it, and reaches the CPU fallback."""

    cuda = False
    upsampling = "fancy"  # libjpeg's, the CPU path's

    def __init__(self, device=None, upsampling=None, *, seconds: float = 0.0, stub: bool = False):
        self.device = device
        self.seconds = float(seconds)
        self.stub = stub
        self.calls = 0  # decode calls: the tests count them
        self.images = 0
        self.declined = 0
        self.backend = f"stand-in ({'stub' if stub else 'CPU decoder'}, {self.seconds:g} s/image)"
        self._zeros = np.zeros((0, 0, 3), np.uint8)

    def decode(self, buffers, boxes, stream=None) -> list[Crop | None]:
        from .decode import decode_rgb

        out: list[Crop | None] = []
        for buf, box in zip(buffers, boxes, strict=True):
            if self.stub:
                h, w = (box.h, box.w) if box is not None else (1, 1)
                if self._zeros.shape[0] < h or self._zeros.shape[1] < w:
                    hh, ww = max(h, self._zeros.shape[0]), max(w, self._zeros.shape[1])
                    self._zeros = np.zeros((hh, ww, 3), np.uint8)
                out.append(Crop(self._zeros, 0, 0, h, w))
                continue
            try:
                img = decode_rgb(bytes(buf), max_pixels=None)
            except Exception:  # declined whole: the CPU fallback decides (and names it)
                self.declined += 1
                out.append(None)
                continue
            if box is None:
                out.append(Crop(img, 0, 0, img.shape[0], img.shape[1]))
            else:
                out.append(Crop(img, box.top, box.left, box.h, box.w))
        self.calls += 1
        self.images += len(out)
        if self.seconds > 0:
            time.sleep(self.seconds * len(out))  # the GIL released, as nvImageCodec's decode
        return out

    def tensor(self, crop: Crop) -> torch.Tensor:
        t = torch.from_numpy(crop.image)
        return t[crop.top : crop.top + crop.h, crop.left : crop.left + crop.w]

    def padded(self, crops: Sequence[Crop], target: torch.device) -> torch.Tensor:
        """As ``DeviceDecoder.padded``; under ``stub``, the batch left unwritten (no copy)."""
        hmax = max(c.h for c in crops)
        wmax = max(c.w for c in crops)
        out = torch.empty((len(crops), hmax, wmax, 3), dtype=torch.uint8, device=target)
        if self.stub:
            return out
        for i, c in enumerate(crops):
            out[i, : c.h, : c.w].copy_(self.tensor(c))
        return out


class _CudaCopier:
    """Crops into a padded batch with the CUDA runtime's ``cudaMemcpy2DAsync`` called through
    ctypes on the runtime torch has loaded: ~2 us of the training thread per crop, where
    building a tensor from each decoded image and copying it costs ~15 us."""

    def __init__(self, lib):
        self.fn = lib.cudaMemcpy2DAsync
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        self.fn.argtypes += [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    @classmethod
    def find(cls) -> _CudaCopier | None:
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
            return cls(ctypes.CDLL(paths[0])) if paths else None
        except (OSError, AttributeError, IndexError):
            return None

    def copy(self, crops: Sequence[Crop], out: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(out.device).cuda_stream
        base, dpitch = out.data_ptr(), out.stride(1)
        per = out.stride(0)
        for i, c in enumerate(crops):
            cai = c.image.__cuda_array_interface__
            ptr = cai["data"][0]
            strides = cai.get("strides")
            spitch = strides[0] if strides else cai["shape"][1] * 3
            src = ptr + c.top * spitch + c.left * 3
            err = self.fn(base + i * per, dpitch, src, spitch, c.w * 3, c.h, 3, stream)
            if err != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")


# --- the batch's resize --------------------------------------------------------------------------


def aa_weights(
    sizes: torch.Tensor,
    out_size: int,
    in_max: int,
    flip: torch.Tensor | None = None,
    interpolation: str = "bilinear",
) -> torch.Tensor:
    """(N, out_size, in_max) float32 weights of torch's antialiased resize
    (``F.interpolate(mode=interpolation, antialias=True, align_corners=False)``: the filter, a
    triangle for bilinear or the cubic with a = -0.5 for bicubic, widened by the scale when
    shrinking, normalised, clipped to each input's own ``sizes[n]``), rows mirrored where
    ``flip``. On a pure enlargement the bilinear weights equal the plain kernel's, which is what
    the CPU path uses there. (torch's window bounds are implied by the filter, which is zero
    outside them, so a few whole-tensor passes build it.)"""
    dev = sizes.device
    n_in = sizes.to(torch.float32).view(-1, 1, 1)
    scale = n_in / out_size
    inv = torch.where(scale >= 1.0, 1.0 / scale, torch.ones_like(scale))
    i = torch.arange(out_size, device=dev, dtype=torch.float32).view(1, -1, 1)
    if flip is not None:  # output column i is mirrored column out_size - 1 - i
        i = torch.where(flip.view(-1, 1, 1), out_size - 1 - i, i)
    center = scale * (i + 0.5)
    j = torch.arange(in_max, device=dev, dtype=torch.float32).view(1, 1, -1)
    x = torch.addcmul((0.5 - center) * inv, j, inv).abs_()  # |j + 0.5 - center| / support
    if interpolation == "bicubic":
        w = _cubic(x)
    else:
        w = x.neg_().add_(1.0).clamp_(min=0.0)
    w.masked_fill_(j >= n_in, 0.0)
    return w.div_(w.sum(-1, keepdim=True))


def _cubic(x: torch.Tensor, a: float = -0.5) -> torch.Tensor:
    """Keys' cubic at ``|x|`` (torch's antialiased bicubic, PIL's BICUBIC: a = -0.5)."""
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _on(values: list, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """A small host list on ``device`` without stalling the host: a pageable copy to a GPU
    waits for the stream (the decode queued on it); a pinned one is queued behind it."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def resize_batch(
    padded: torch.Tensor,
    heights: Sequence[int],
    widths: Sequence[int],
    size: int,
    flips: Sequence[bool],
    out: torch.Tensor,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    interpolation: str = "bilinear",
) -> None:
    """Resize each crop of ``padded`` ((N, Hmax, Wmax, 3) uint8, crop n in its top-left
    ``heights[n]`` x ``widths[n]``) to ``size`` x ``size``, mirror where ``flips``, and write
    them into ``out`` ((N, 3, size, size), any dtype and strides) with ``interpolation``'s
    antialiased filter (``aa_weights``): rounded for uint8, else
    ``x * scale + shift`` from the unrounded values. Two batched matrix products (float16 on
    CUDA, exact for uint8 inputs, float32 accumulation; float32 on the CPU), not a kernel per
    image."""
    n, hmax, wmax, _ = padded.shape
    dev = padded.device
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
    meta = _on([*heights, *widths, *(1.0 if f else 0.0 for f in flips)], dev)
    hs, ws, fl = meta[:n], meta[n : 2 * n], meta[2 * n :] > 0.5
    wy = aa_weights(hs, size, hmax, None, interpolation).to(dtype)
    wx = aa_weights(ws, size, wmax, fl, interpolation).to(dtype)
    x = padded.view(n, hmax, wmax * 3).to(dtype)
    t = torch.bmm(wy, x).view(n, size, wmax, 3)  # rows done: (N, Y, Wmax, 3)
    t = t.permute(0, 2, 1, 3).reshape(n, wmax, size * 3)
    r = torch.bmm(wx, t).view(n, size, size, 3).permute(0, 3, 2, 1)  # (N, 3, Y, X)
    if out.dtype == torch.uint8:
        out.copy_(r.round_().clamp_(0, 255))
    elif scale is not None:
        out.copy_(torch.addcmul(shift, r.float(), scale))
    else:
        out.copy_(r)


def groups(crops: Sequence[Crop], limit: int = GROUP_BYTES) -> list[list[int]]:
    """The crops' positions in groups of similar size whose padded batch stays under
    ``limit`` bytes: sorted by height and width, so one large photo does not pad the rest."""
    order = sorted(range(len(crops)), key=lambda i: (crops[i].h, crops[i].w))
    out: list[list[int]] = []
    group: list[int] = []
    hmax = wmax = 0
    for i in order:
        h, w = max(hmax, crops[i].h), max(wmax, crops[i].w)
        if group and (len(group) + 1) * h * w * 3 > limit:
            out.append(group)
            group, h, w = [], crops[i].h, crops[i].w
        group.append(i)
        hmax, wmax = h, w
    if group:
        out.append(group)
    return out


def place(
    crop: torch.Tensor,
    size: int | None,
    flip: bool,
    out: torch.Tensor,
    interpolation: str = "bilinear",
) -> None:
    """Put the (h, w, 3) uint8 ``crop`` into ``out`` ((3, S, S) or, without ``size``, (3, h,
    w); uint8 or float32, any strides): resized with antialiasing when it shrinks (bilinear, as
    the CPU path), mirrored if ``flip``. One image at a time: the CPU path's own resize, the
    reference the batched ``resize_batch`` is tested against."""
    x = crop.permute(2, 0, 1).unsqueeze(0)
    if size is None:  # a full-size image: no box, no flip
        out.copy_(x[0])
        return
    out.copy_(resized(x, size, flip, interpolation)[0])


#: nvImageCodec's module, or None where it is not installed (benchmarks/bench_device.py's probe).
nvimgcodec = _nvimgcodec
