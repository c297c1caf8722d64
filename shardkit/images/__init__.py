"""Images: which bytes are images, decoding them, and the crop/resize geometry of a batch.

- ``checks``: which files and bytes are images (one extension set, one magic-number table), the
  cheap structural check and the full decode check.
- ``decode``: JPEG through TurboJPEG (and the region decoder built from ``_native.c``), Pillow
  for the rest.
- ``geometry``: crop and resize specs and ``TensorDecoder`` (torch; imported on its own).

A GPU decoder plugs in beside ``decode``: ``geometry.TensorDecoder`` is the one caller that turns
bytes into a batch slot.
"""
