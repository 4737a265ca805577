#!/usr/bin/env python
"""Write a small synthetic corpus of "document page" images in every common format.

    python scripts/make_demo_corpus.py OUT_DIR [--pages 24] [--seed 0] [--broken]

Pages are deterministic per (seed, index): coloured bars standing in for text lines, a
title block and a figure. Formats rotate through RGB JPEG, RGBA PNG, palette GIF,
greyscale PNG, WEBP and BMP, so the identifiers exercise vLLM's io-config path
(non-RGB images are converted and hashed with their io config). ``--broken`` adds an
unreadable ``.jpg`` to show how precompute reports and skips bad files.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

FORMATS = [("jpg", "JPEG", "RGB"), ("png", "PNG", "RGBA"), ("gif", "GIF", "P"),
           ("png", "PNG", "L"), ("webp", "WEBP", "RGB"), ("bmp", "BMP", "RGB")]


def page(index: int, seed: int = 0, size=(96, 128)):
    from PIL import Image, ImageDraw

    rng = random.Random(seed * 1_000_003 + index)
    im = Image.new("RGB", size, (250, 250, 245))
    d = ImageDraw.Draw(im)
    d.rectangle([6, 6, size[0] - 6, 18], fill=(rng.randrange(256), 40, 120))
    y = 26
    while y < size[1] - 10:
        if rng.random() < 0.15:
            h = rng.randrange(14, 30)
            d.rectangle([10, y, size[0] - 10, y + h],
                        fill=tuple(rng.randrange(256) for _ in range(3)))
            y += h + 4
        else:
            d.rectangle([8, y, rng.randrange(size[0] // 2, size[0] - 8), y + 3], fill=(30, 30, 30))
            y += 7
    return im


def save_page(im, path_base: str, index: int) -> str:
    ext, fmt, mode = FORMATS[index % len(FORMATS)]
    if mode == "RGBA":
        im = im.convert("RGBA")
        im.putalpha(200 + index % 50)
    elif mode == "P":
        im = im.convert("P", palette=1, colors=64)  # 1 = Image.Palette.ADAPTIVE
    elif mode == "L":
        im = im.convert("L")
    path = f"{path_base}.{ext}"
    im.save(path, fmt)
    return path


def make_corpus(out: str, pages: int = 24, seed: int = 0, broken: bool = False) -> list[str]:
    paths = []
    for i in range(pages):
        sub = os.path.join(out, f"doc{i // 4:03d}")
        os.makedirs(sub, exist_ok=True)
        paths.append(save_page(page(i, seed), os.path.join(sub, f"page{i % 4}"), i))
    if broken:
        p = os.path.join(out, "broken.jpg")
        with open(p, "wb") as f:
            f.write(b"this is not an image\n" * 4)
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--broken", action="store_true")
    a = ap.parse_args(argv)
    paths = make_corpus(a.out, a.pages, a.seed, a.broken)
    print(f"{len(paths)} files in {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
