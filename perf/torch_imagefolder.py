"""The PyTorch peer of `python -m perf data`: torchvision's ImageFolder with the ImageNet
reference transforms, restated with PIL and torch.

torchvision cannot be imported on the machines these benchmarks run on (only a CUDA build
of it is served, and its extension fails beside the CPU torch), so this module restates
what the peer runs, step for step as torchvision 0.2x does it on PIL images:
ImageFolder's scan (classes sorted, files sorted) and pil_loader (open, convert("RGB")),
RandomResizedCrop(224) (get_params with torch's generator, crop then bilinear resize),
RandomHorizontalFlip, or Resize(256) + CenterCrop(224), then ToTensor (uint8 HWC to float
CHW / 255) and Normalize (sub_ mean, div_ std). Batches come from
torch.utils.data.DataLoader with the same worker count as dynar's decode threads.
"""
import math
import os

import numpy as np
import torch
from PIL import Image

EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class ImageFolder(torch.utils.data.Dataset):
    def __init__(self, root, train, size=224):
        self.train, self.size = train, size
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = []
        for label, name in enumerate(self.classes):
            for dirpath, dirnames, filenames in sorted(os.walk(os.path.join(root, name),
                                                               followlinks=True)):
                for f in sorted(filenames):
                    if f.lower().endswith(EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, f), label))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        image = self._random_resized_crop_flip(image) if self.train else self._resize_center(image)
        tensor = torch.from_numpy(np.array(image, np.uint8, copy=True))
        tensor = tensor.permute(2, 0, 1).contiguous().to(torch.float32).div(255)
        return tensor.sub_(MEAN).div_(STD), label

    def _random_resized_crop_flip(self, image):
        width, height = image.size
        area = height * width
        log_ratio = torch.log(torch.tensor((3 / 4, 4 / 3)))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(0.08, 1.0).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                break
        else:
            in_ratio = width / height
            if in_ratio < 3 / 4:
                w, h = width, int(round(width / (3 / 4)))
            elif in_ratio > 4 / 3:
                w, h = int(round(height * 4 / 3)), height
            else:
                w, h = width, height
            i, j = (height - h) // 2, (width - w) // 2
        image = image.crop((j, i, j + w, i + h)).resize((self.size, self.size), Image.BILINEAR)
        if torch.rand(1) < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return image

    def _resize_center(self, image):
        short = int(round(self.size / 0.875))
        w, h = image.size
        oh, ow = (int(short * h / w), short) if w <= h else (short, int(short * w / h))
        image = image.resize((ow, oh), Image.BILINEAR)
        top, left = int(round((oh - self.size) / 2.0)), int(round((ow - self.size) / 2.0))
        return image.crop((left, top, left + self.size, top + self.size))


def loader(root, workers, batch_size, train=True):
    return torch.utils.data.DataLoader(ImageFolder(root, train), batch_size=batch_size,
                                       shuffle=train, num_workers=workers, drop_last=train,
                                       persistent_workers=workers > 0)
