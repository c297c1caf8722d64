"""Decoding a whole batch in the training process with NVIDIA's nvImageCodec, on its device.

When the CPUs cannot decode as fast as the GPU trains (ResNet-18 on an H100 takes ~12,000 images/s;
16 cores decode ~5,000), ``ShardLoader(decode_on="device")`` has its workers read, shuffle and
choose each sample's crop from the JPEG header as usual, but put the compressed bytes in the ring;
this module decodes the batch where the training runs. nvImageCodec is the library DALI decodes
with: on a GPU it takes nvJPEG's hardware engine where the GPU has one (A100, H100: no CUDA cores
taken from the model), else its CUDA or hybrid backend; without a GPU its CPU backend answers the
same calls, which is how the path is built and tested on machines with no GPU.

Each image is decoded as its crop's region only (``CodeStream.get_sub_code_stream(region=)``, the
same box the CPU path crops: ``geometry.TensorDecoder.crop_box``), then resized with antialiasing,
flipped and placed in the batch by torch on the device. The region is decoded at full scale (the
CPU path may decode at 1/2..1/8 DCT scale first), so pixels differ slightly from the CPU path's
where it scaled: ``MAX_MEAN_DIFFERENCE`` bounds the mean difference (measured, tested). Images
nvImageCodec declines (a backend without PNG or CMYK, a damaged header) are decoded by the CPU
decoder in the same batch, with the same box.

nvImageCodec is an optional extra (``pip install 'shardkit[gpu]'``); nothing here imports it
until a decoder is built.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import MissingExtraError
from .geometry import CropBox, resized

__all__ = ["MAX_MEAN_DIFFERENCE", "DeviceDecoder", "device_decode_available", "place"]

#: Bound on the mean absolute difference, in 8-bit levels over a batch, between the device path
#: and the CPU path for the same samples and crops. Crops shrunk less than 2x are decoded alike
#: (the same pixels on the CPU backend); where the CPU path decodes at a DCT scale, they differ:
#: random-resized crops to 224 of the ImageNet-shaped set (500x375) measured a mean of 0.06 (the
#: worst 1% of images 2.3, the worst 4.5); shrinking those photos to 64 (1/4-1/8 DCT scale)
#: measured 2.8, above this bound. nvJPEG's IDCT on a GPU is to be measured there.
MAX_MEAN_DIFFERENCE = 1.0


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
            "decode_on='device' decodes with NVIDIA's nvImageCodec: pip install 'shardkit[gpu]'"
        ) from None
    return nvimgcodec


def device_decode_available() -> bool:
    """Whether nvImageCodec can be imported here."""
    try:
        _nvimgcodec()
    except MissingExtraError:
        return False
    return True


class DeviceDecoder:
    """Encoded images -> their crops as (h, w, 3) uint8 tensors on ``device`` (None: the CPU).

    On CUDA the backends are tried in the order hardware engine, CUDA, hybrid; on the CPU,
    nvImageCodec's CPU backend. ``backend`` names what was asked for (``repr(loader)``)."""

    def __init__(self, device: torch.device | None):
        nv = _nvimgcodec()
        self.device = device
        self.cuda = device is not None and device.type == "cuda"
        kinds = nv.BackendKind
        with _quiet_stderr():
            if self.cuda:
                index = device.index if device.index is not None else torch.cuda.current_device()
                order = [kinds.HW_GPU_ONLY, kinds.GPU_ONLY, kinds.HYBRID_CPU_GPU]
                self.decoder = nv.Decoder(device_id=index, backends=[nv.Backend(k) for k in order])
                self.backend = f"nvImageCodec on cuda:{index} (hardware, CUDA, hybrid)"
            else:
                self.decoder = nv.Decoder(
                    device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[nv.Backend(kinds.CPU_ONLY)]
                )
                self.backend = "nvImageCodec CPU backend"
        self._nv = nv

    def decode(
        self,
        buffers: Sequence[np.ndarray],
        boxes: Sequence[CropBox | None],
        stream: torch.cuda.Stream | None = None,
    ) -> list[torch.Tensor | None]:
        """Each buffer's crop (its whole image where its box is None), None where nvImageCodec
        declined it. The buffers are read in place (they must live until the decode is done:
        on CUDA, until ``stream`` has passed this point)."""
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
        out: list[torch.Tensor | None] = [None] * len(buffers)
        if not streams:
            return out
        with _quiet_stderr():
            if self.cuda:
                images = self.decoder.decode(streams, cuda_stream=stream.cuda_stream)
            else:
                images = self.decoder.decode(streams)
        for i, img in zip(where, images, strict=True):
            if img is None:
                continue
            if self.cuda:
                out[i] = torch.as_tensor(img, device=self.device)
            else:
                out[i] = torch.from_numpy(np.asarray(img.cpu()))
        return out


def place(crop: torch.Tensor, size: int | None, flip: bool, out: torch.Tensor) -> None:
    """Put the (h, w, 3) uint8 ``crop`` into ``out`` ((3, S, S) or, without ``size``, (3, h,
    w); uint8 or float32, any strides): resized with antialiasing when it shrinks (bilinear, as
    the CPU path), mirrored if ``flip``.

    On the CPU this is the CPU path's own resize (torch's uint8 kernel on a channels_last crop:
    the same pixels for the same crop); on CUDA, whose antialiased resize takes no uint8, the
    crop is resized as float and rounded."""
    x = crop.permute(2, 0, 1).unsqueeze(0)
    if size is None:  # a full-size image: no box, no flip
        out.copy_(x[0])
        return
    if not crop.is_cuda:
        out.copy_(resized(x, size, flip)[0])
        return
    h, w = x.shape[-2:]
    if (h, w) != (size, size):
        x = F.interpolate(
            x.float(),
            size=(size, size),
            mode="bilinear",
            antialias=h > size or w > size,
            align_corners=False,
        )
        if out.dtype == torch.uint8:
            x = x.round_().clamp_(0, 255)
    if flip:
        x = x.flip(-1)
    out.copy_(x[0])
