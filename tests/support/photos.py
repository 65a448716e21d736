"""Image folders built from real photographs that installed packages ship, and edge cases.

scikit-learn ships two photographs (china.jpg, flower.jpg, 427x640); scikit-image's `data`
module more, where it is installed. Each class takes its own photograph, and its images are
random crops of it rescaled to several sizes, saved as JPEG (some as PNG), so that a small
network can tell the classes apart and every decode path is exercised. edge_cases() writes
the unusual files a real collection holds (grayscale, CMYK, palette, RGBA, EXIF-rotated),
and bad_files() the unreadable ones. Nothing here is committed: the tests build it.
"""
import io
import os

import numpy as np
from PIL import Image

_SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "motorcycle_left", "immunohistochemistry")


def photographs():
    """The real RGB photographs available, as uint8 (H, W, 3) arrays (at least two)."""
    import sklearn.datasets
    folder = os.path.join(os.path.dirname(sklearn.datasets.__file__), "images")
    photos = [np.asarray(Image.open(os.path.join(folder, name)).convert("RGB"))
              for name in ("china.jpg", "flower.jpg")]
    try:
        from skimage import data as skdata
    except ImportError:
        return photos
    for name in _SKIMAGE_PHOTOS:
        try:
            image = np.asarray(getattr(skdata, name)())
        except Exception:  # noqa: BLE001 - a photo the installed version lacks or cannot load
            continue
        if image.ndim == 3 and image.shape[2] >= 3:
            photos.append(np.ascontiguousarray(image[:, :, :3]))
    return photos


def build_folder(root, classes=3, train_per_class=8, val_per_class=3, sizes=(40, 96),
                 png_every=5, seed=0):
    """DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg; image sides drawn in `sizes`."""
    rng = np.random.default_rng(seed)
    photos = photographs()
    names = [f"class_{c:02d}" for c in range(classes)]
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c, name in enumerate(names):
            photo = photos[c % len(photos)]
            folder = os.path.join(root, split, name)
            os.makedirs(folder, exist_ok=True)
            for k in range(count):
                image = _random_view(photo, rng, sizes)
                if png_every and k % png_every == png_every - 1:
                    image.save(os.path.join(folder, f"img_{k:04d}.png"))
                else:
                    image.save(os.path.join(folder, f"img_{k:04d}.jpg"), quality=90)
    return names


def _random_view(photo, rng, sizes):
    h, w = photo.shape[:2]
    ch, cw = int(rng.integers(h // 3, h + 1)), int(rng.integers(w // 3, w + 1))
    top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    out_h, out_w = int(rng.integers(*sizes)), int(rng.integers(*sizes))
    return Image.fromarray(photo[top:top + ch, left:left + cw]).resize((out_w, out_h),
                                                                      Image.BILINEAR)


def edge_cases(folder, photo):
    """Unusual but valid images in `folder`; returns their file names."""
    os.makedirs(folder, exist_ok=True)
    base = Image.fromarray(photo[:120, :160])
    files = {
        "gray.jpg": lambda p: base.convert("L").save(p, quality=90),
        "cmyk.jpg": lambda p: base.convert("CMYK").save(p, quality=90),
        "palette.png": lambda p: base.convert("P").save(p),
        "rgba.png": lambda p: base.convert("RGBA").save(p),
        "gray16.png": lambda p: base.convert("I;16").save(p),
        "exif_rotated.jpg": lambda p: base.save(p, quality=90, exif=_orientation_exif(6)),
        "large.jpg": lambda p: Image.fromarray(photo).resize((1280, 854)).save(p, quality=90),
        "tiny.bmp": lambda p: base.resize((7, 5)).save(p),
    }
    for name, write in files.items():
        write(os.path.join(folder, name))
    return sorted(files)


def _orientation_exif(value):
    exif = Image.Exif()
    exif[0x0112] = value
    return exif


def bad_files(folder, photo):
    """Unreadable files with image extensions; name -> what is wrong."""
    os.makedirs(folder, exist_ok=True)
    good = io.BytesIO()
    Image.fromarray(photo[:100, :100]).save(good, "JPEG", quality=90)
    jpeg = good.getvalue()
    png = io.BytesIO()
    Image.fromarray(photo[:100, :100]).save(png, "PNG")
    files = {
        "truncated.jpg": jpeg[:len(jpeg) // 2],
        "corrupt.jpg": jpeg[:200] + bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8)),
        "text.jpg": b"this is not an image\n",
        "empty.png": b"",
        "truncated.png": png.getvalue()[:len(png.getvalue()) // 2],
    }
    for name, blob in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(blob)
    return sorted(files)
