"""Per-image transforms of decoded photographs, torchvision's ImageNet reference recipe:

    train  RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)) + RandomHorizontalFlip
    eval   Resize(round(size / 0.875)) + CenterCrop(size)         (224 -> 256 -> 224)

and, for packed copies of CIFAR-style arrays, the 4-pixel padded random crop + flip of
augment.py (per image instead of per batch).

Random draws are made for the whole GLOBAL batch from a generator seeded by (seed, epoch,
step) and sample k of the global batch uses row k: a crop depends on the seed, the epoch and
the sample's position in the epoch only, never on the rank that decodes it. The crop box is
computed on the image's full size exactly as torchvision computes it; the pixels are
Pillow's antialiased bilinear resize (torchvision's PIL path). A JPEG whose crop is at least
twice the output in both directions is decoded at a DCT-reduced size first (libjpeg-turbo's
1/2, 3/8, 1/4, 1/8 scalings), which changes pixels by interpolation error only.
"""
import math

import numpy as np
from PIL import Image

from . import augment

SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
ATTEMPTS = 10
EVAL_CROP_FRACTION = 0.875        # CenterCrop(224) of Resize(256)
_STREAM = 2                       # loader permutation 0, CIFAR batches 1, these 2
_MIN_DCT_FACTOR = 2.0             # smaller M/8 factors decode slower than full size


class Crop:
    """A region of the full-size image, (x0, y0, x1, y1) in pixels, to crop and resize to
    the output, and whether to flip it."""

    __slots__ = ("x0", "y0", "x1", "y1", "flip")

    def __init__(self, x0, y0, x1, y1, flip):
        self.x0, self.y0, self.x1, self.y1, self.flip = x0, y0, x1, y1, flip


def random_resized_crop_box(height, width, scale_u, ratio_u, top_u, left_u):
    """(top, left, h, w) of torchvision's RandomResizedCrop.get_params for an image of
    height x width, its uniform draws given: scale_u, ratio_u (ATTEMPTS each) in [0, 1),
    top_u, left_u in [0, 1) for the position (torch.randint(0, n) is floor(u * n))."""
    area = height * width
    log_lo, log_hi = math.log(RATIO[0]), math.log(RATIO[1])
    for attempt in range(ATTEMPTS):
        target_area = area * (SCALE[0] + (SCALE[1] - SCALE[0]) * float(scale_u[attempt]))
        aspect = math.exp(log_lo + (log_hi - log_lo) * float(ratio_u[attempt]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return (int(float(top_u) * (height - h + 1)), int(float(left_u) * (width - w + 1)),
                    h, w)
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resize_shorter(height, width, short):
    """torchvision's Resize(short) output size (h, w): the longer side is truncated."""
    if width <= height:
        return int(short * height / width), short
    return short, int(short * width / height)


def center_crop_offsets(height, width, size):
    """(top, left) of torchvision's CenterCrop(size) on a height x width image."""
    return int(round((height - size) / 2.0)), int(round((width - size) / 2.0))


class RandomResizedCropFlip:
    """Training transform of photographs: RandomResizedCrop(size) + horizontal flip."""

    def __init__(self, size):
        self.size = size
        self.name = f"RandomResizedCrop({size})+flip"

    def draws(self, seed, epoch, step, batch_size):
        rng = np.random.default_rng([seed, _STREAM, epoch, step])
        return (rng.random((batch_size, ATTEMPTS)), rng.random((batch_size, ATTEMPTS)),
                rng.random(batch_size), rng.random(batch_size), rng.random(batch_size) < 0.5)

    def crop(self, height, width, draws, k):
        scale_u, ratio_u, top_u, left_u, flip = draws
        top, left, h, w = random_resized_crop_box(height, width, scale_u[k], ratio_u[k],
                                                  top_u[k], left_u[k])
        return Crop(left, top, left + w, top + h, bool(flip[k]))

    def render(self, opened, draws, k, out):
        resized_crop(opened, self.crop(opened.height, opened.width, draws, k), self.size, out)


class ResizeCenterCrop:
    """Evaluation transform of photographs: Resize(size / 0.875) + CenterCrop(size)."""

    def __init__(self, size):
        self.size = size
        self.short = int(round(size / EVAL_CROP_FRACTION))
        self.name = f"Resize({self.short})+CenterCrop({size})"

    def draws(self, seed, epoch, step, batch_size):
        return None

    def render(self, opened, draws, k, out):
        # torchvision's order, resize the whole image then crop: one resize of the crop's
        # region alone would read the same taps but round differently (up to 20 levels).
        h, w = opened.height, opened.width
        oh, ow = resize_shorter(h, w, self.short)
        pixels = decode_for(opened, h, w, oh, ow)
        s = dct_scale(pixels, w)
        image = _pillow(pixels).resize((ow, oh), Image.BILINEAR, box=(0, 0, w * s, h * s))
        top, left = center_crop_offsets(oh, ow, self.size)
        _write(np.asarray(image)[top:top + self.size, left:left + self.size], False, out)


class PaddedCropFlip:
    """CIFAR's augmentation for fixed-size stored images: a random window of the 4-pixel
    zero-padded image and a horizontal flip, drawn as augment.draw draws for a batch, so a
    packed copy of an array dataset is augmented exactly as the array is."""

    name = f"pad {augment.PAD} + random crop + flip"

    def draws(self, seed, epoch, step, batch_size):
        return augment.draw(seed, epoch, step, batch_size)

    def render(self, opened, draws, k, out):
        dy, dx, flip = (int(draws[0][k]), int(draws[1][k]), bool(draws[2][k]))
        image = _chw(opened.pixels())
        _, h, w = image.shape
        out[...] = 0
        # Window rows [dy, dy + h) of the padded image are image rows [dy - PAD, ...).
        y0, x0 = dy - augment.PAD, dx - augment.PAD
        src = image[:, max(y0, 0):min(y0 + h, h), max(x0, 0):min(x0 + w, w)]
        oy, ox = max(-y0, 0), max(-x0, 0)
        window = out[:, oy:oy + src.shape[1], ox:ox + src.shape[2]]
        window[...] = src
        if flip:
            out[...] = out[:, :, ::-1].copy()


class Identity:
    """Stored images as they are (evaluation of array datasets, unaugmented training)."""

    name = "none"

    def draws(self, seed, epoch, step, batch_size):
        return None

    def render(self, opened, draws, k, out):
        out[...] = _chw(opened.pixels())


def _chw(pixels):
    return pixels.transpose(2, 0, 1)



def decode_for(opened, region_h, region_w, out_h, out_w):
    """The pixels of `opened` to resize a region_h x region_w region of it (full-size
    pixels) to out_h x out_w from: DCT-scaled when that region is twice the output or more
    in both directions, else at full size."""
    if opened.scalable and min(region_h / out_h, region_w / out_w) >= _MIN_DCT_FACTOR:
        return opened.pixels(math.ceil(opened.height * out_h / region_h),
                             math.ceil(opened.width * out_w / region_w))
    return opened.pixels()


def dct_scale(pixels, width):
    """The scale M/8 at which libjpeg-turbo decoded `pixels` from an image `width` wide (1
    at full size). A scaled image is ceil(size * M / 8) pixels, its pixel k covering
    [k, k + 1) * 8 / M of the full image: boxes scale by M/8, not by the size ratio."""
    return round(8 * pixels.shape[1] / width) / 8 if pixels.shape[1] != width else 1.0


def _pillow(pixels):
    return Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)


def _write(result, flip, out):
    if result.ndim == 2:
        result = result[:, :, None]
    if flip:
        result = result[:, ::-1]
    out[...] = result.transpose(2, 0, 1)


def resized_crop(opened, crop, size, out):
    """Write the crop of `opened` resized to size x size, flipped if asked, into out (C,
    size, size) uint8: torchvision's crop-then-resize, or, from DCT-scaled pixels, one
    resize of the scaled region."""
    pixels = decode_for(opened, crop.y1 - crop.y0, crop.x1 - crop.x0, size, size)
    s = dct_scale(pixels, opened.width)
    image = _pillow(pixels)
    if s == 1.0:
        image = image.crop((crop.x0, crop.y0, crop.x1, crop.y1)).resize(
            (size, size), Image.BILINEAR)
    else:
        image = image.resize((size, size), Image.BILINEAR,
                             box=(crop.x0 * s, crop.y0 * s, crop.x1 * s, crop.y1 * s))
    _write(np.asarray(image), crop.flip, out)


def for_split(kind, train, augment_on, size):
    """The transform of a split: kind "photo" (image folders and their packed copies) or
    "array" (packed copies of fixed-size array datasets)."""
    if kind == "photo":
        return RandomResizedCropFlip(size) if train and augment_on else ResizeCenterCrop(size)
    return PaddedCropFlip() if train and augment_on else Identity()
