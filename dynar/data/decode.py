"""Stored images to RGB (or grayscale) pixels: JPEG by libjpeg-turbo (simplejpeg), with its
reduced-size DCT scaling when the caller needs fewer pixels; everything else by Pillow.

simplejpeg decodes a 427x640 photograph in 1.9 ms against Pillow's 4.6 ms on this machine
with bit-identical pixels (both are libjpeg-turbo with the accurate DCT and fancy
upsampling), so JPEGs take it; CMYK/YCCK JPEGs, PNG, BMP, TIFF, WebP, ... go through
Pillow's `convert("RGB")`, as torchvision's ImageFolder loader does. The EXIF orientation
tag is ignored, as torchvision ignores it: a photograph is trained on as stored.

Both libraries release the GIL while they decode, so worker threads decode in parallel.
Every failure is a DataError naming the record.
"""
import io
import warnings

import numpy as np
import simplejpeg
from PIL import Image

from .dataset import DataError

JPEG_MAGIC = b"\xff\xd8\xff"
# Pillow's notes on odd but readable files (palette transparency, TIFF tags beyond the end)
# would print once per image from the decode threads; a file it cannot read raises instead.
# (A filter set once: warnings.catch_warnings is not thread-safe.)
warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
# Colour spaces libjpeg-turbo converts differently from Pillow: decoded by Pillow instead.
_PILLOW_JPEG_SPACES = ("CMYK", "YCCK")


class Record:
    """One stored image: `data` is an encoded file (encoding "file": JPEG or any format
    Pillow reads), a JPEG ("jpeg"), or raw uint8 pixels ("raw", `shape` (H, W, C))."""

    __slots__ = ("name", "data", "encoding", "shape")

    def __init__(self, name, data, encoding="file", shape=None):
        self.name, self.data, self.encoding, self.shape = name, data, encoding, shape


class Opened:
    """A record whose header has been read: its full size, and its pixels on demand."""

    def __init__(self, record):
        self.record = record
        self._pillow = None
        data = record.data
        if record.encoding == "raw":
            self.height, self.width, self.channels = record.shape
            self.kind = "raw"
        elif bytes(data[:3]) == JPEG_MAGIC:
            try:
                self.height, self.width, space, _ = simplejpeg.decode_jpeg_header(data)
            except ValueError as e:
                raise DataError(f"{record.name}: corrupt or truncated JPEG ({e})") from None
            self.kind = "pillow" if space in _PILLOW_JPEG_SPACES else "jpeg"
            self.channels = 3
        elif record.encoding == "jpeg":
            raise DataError(f"{record.name}: not a JPEG (starts with {bytes(data[:4])!r})")
        else:
            self._pillow = _pillow_open(record)
            self.width, self.height = self._pillow.size
            self.kind, self.channels = "pillow", 3
        if self.kind == "jpeg" and self.height * self.width == 0:
            raise DataError(f"{record.name}: empty image ({self.width}x{self.height})")

    @property
    def scalable(self):
        """Whether pixels() can decode at a reduced size (JPEG's DCT scaling)."""
        return self.kind == "jpeg"

    def pixels(self, min_height=0, min_width=0):
        """(H, W, C) uint8 C-contiguous pixels. For a JPEG, the smallest DCT-scaled size with
        at least min_height x min_width pixels (the full size when those are 0)."""
        rec = self.record
        if self.kind == "raw":
            h, w, c = rec.shape
            try:
                return np.frombuffer(rec.data, np.uint8, h * w * c).reshape(h, w, c)
            except ValueError:
                raise DataError(f"{rec.name}: {len(rec.data)} bytes, not {h}x{w}x{c} pixels") from None
        if self.kind == "jpeg":
            try:
                return simplejpeg.decode_jpeg(rec.data, colorspace="RGB", min_height=min_height,
                                              min_width=min_width)
            except ValueError as e:
                raise DataError(f"{rec.name}: corrupt or truncated JPEG ({e})") from None
        image = self._pillow or _pillow_open(rec)
        try:
            return np.asarray(image.convert("RGB"))
        except Exception as e:  # noqa: BLE001 - a damaged file makes Pillow raise nearly anything
            raise DataError(f"{rec.name}: corrupt or truncated image ({type(e).__name__}: "
                            f"{e})") from None


def _pillow_open(record):
    try:
        image = Image.open(io.BytesIO(record.data))
        image.size  # noqa: B018 - the header must parse
        return image
    except Image.UnidentifiedImageError:
        raise DataError(f"{record.name}: not an image file (no decoder recognises it)") from None
    except Exception as e:  # noqa: BLE001 - as above
        raise DataError(f"{record.name}: unreadable image ({type(e).__name__}: {e})") from None
