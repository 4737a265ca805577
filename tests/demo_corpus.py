#!/usr/bin/env python
"""Write a small synthetic corpus of "document page" images in every common format.

    python scripts/make_demo_corpus.py OUT_DIR [--pages 24] [--seed 0] [--broken]
                                           [--size 96x128]

(the command line; the tests import :func:`make_corpus` from here)

Pages are deterministic per (seed, index): coloured bars standing in for text lines, a
title block and a figure. ``--size`` (default 96x128) draws the same layout at another
size; above the default width each text line is broken into words, so a real-sized page
(e.g. ``--size 1240x1754``, A4 at 150 dpi) costs what a document scan costs to decode. Formats rotate through RGB JPEG, RGBA PNG, palette GIF,
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


DEFAULT_SIZE = (96, 128)


def page(index: int, seed: int = 0, size=DEFAULT_SIZE):
    from PIL import Image, ImageDraw

    rng = random.Random(seed * 1_000_003 + index)
    scale = size[0] / DEFAULT_SIZE[0]

    def px(v: int) -> int:  # layout units (the default page's pixels) -> pixels
        return int(round(v * scale))

    # words only on pages wider than the default (their own generator: the layout, and
    # the default page's bytes, do not change)
    words = random.Random(f"{seed}/{index}/words") if scale > 1 else None
    im = Image.new("RGB", size, (250, 250, 245))
    d = ImageDraw.Draw(im)
    d.rectangle([px(6), px(6), size[0] - px(6), px(18)], fill=(rng.randrange(256), 40, 120))
    y = px(26)
    while y < size[1] - px(10):
        if rng.random() < 0.15:
            h = px(rng.randrange(14, 30))
            d.rectangle([px(10), y, size[0] - px(10), y + h],
                        fill=tuple(rng.randrange(256) for _ in range(3)))
            y += h + px(4)
        else:
            end = rng.randrange(size[0] // 2, size[0] - px(8))
            if words is None:
                d.rectangle([px(8), y, end, y + px(3)], fill=(30, 30, 30))
            else:  # the band of one default text line holds real-sized lines of words
                for line_y in range(y, y + px(7) - 10, 18):
                    x, line_end = px(8), words.randrange(size[0] // 2, end + 1)
                    while x < line_end:
                        w = min(line_end, x + words.randrange(12, 90))
                        d.rectangle([x, line_y, w, line_y + 10], fill=(30, 30, 30))
                        x = w + 8
            y += px(7)
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


def make_corpus(out: str, pages: int = 24, seed: int = 0, broken: bool = False,
                size=DEFAULT_SIZE) -> list[str]:
    paths = []
    for i in range(pages):
        sub = os.path.join(out, f"doc{i // 4:03d}")
        os.makedirs(sub, exist_ok=True)
        paths.append(save_page(page(i, seed, tuple(size)), os.path.join(sub, f"page{i % 4}"), i))
    if broken:
        p = os.path.join(out, "broken.jpg")
        with open(p, "wb") as f:
            f.write(b"this is not an image\n" * 4)
        paths.append(p)
    return paths


def parse_size(text: str) -> tuple[int, int]:
    """``"1240x1754"`` -> ``(1240, 1754)`` (at least the default page's 96x128)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 1240x1754: {text!r}")
    if w < DEFAULT_SIZE[0] or h < DEFAULT_SIZE[1]:
        raise argparse.ArgumentTypeError(f"at least {DEFAULT_SIZE[0]}x{DEFAULT_SIZE[1]}: {text!r}")
    return w, h


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--broken", action="store_true")
    ap.add_argument("--size", type=parse_size, default=DEFAULT_SIZE, metavar="WxH",
                    help="page size in pixels (default 96x128; 1240x1754: A4 at 150 dpi)")
    a = ap.parse_args(argv)
    paths = make_corpus(a.out, a.pages, a.seed, a.broken, size=a.size)
    print(f"{len(paths)} files in {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
