"""Images: which bytes are images, decoding them, and the crop/resize geometry of a batch.

- ``checks``: which files and bytes are images (one extension set, one magic-number table), the
  cheap structural check and the full decode check.
- ``decode``: JPEG through TurboJPEG (and the region decoder built from ``_native.c``), Pillow
  for the rest.
- ``crops``: the crop objects (``RandomResizedCrop``, ``CenterCrop``, ``RandomCrop``): a box
  chosen from the header, their arguments checked at construction.
- ``options``: ``Decode``, what a stored image becomes, the one value every reader takes (no
  torch).
- ``geometry``: ``TensorDecoder``, crop, DCT-scaled decode and resize in one pass (torch;
  imported on its own).
- ``device``: a whole batch decoded in the training process with nvImageCodec, on the GPU.
- ``xxh_x86dispatch`` (with ``xxhash.h``): the xxHash library, vendored unchanged, compiled into
  ``_native.c`` for the sample digest its tar parser checks (XXH3-64, dispatched to AVX2 at run
  time on x86-64).

A GPU decoder plugs in beside ``decode``: ``geometry.TensorDecoder`` is the one caller that turns
bytes into a batch slot.
"""
