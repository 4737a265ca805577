"""Real media files for tests, made offline: tiny videos (OpenCV, vLLM's own video
decoder dependency), a decompression bomb, and a corpus of hostile files beside good ones.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np


def make_video(path: str | os.PathLike, *, frames: int = 8, fps: float = 4.0,
               size: tuple[int, int] = (64, 48), fourcc: str = "mp4v", seed: int = 0) -> Path:
    """A small real video (``fourcc`` mp4v -> .mp4, MJPG -> .avi, VP80 -> .webm): a moving
    bar over a coloured background, different per ``seed``."""
    import cv2

    path = Path(path)
    w, h = size
    # OpenCV picks the container by suffix: write under the right one, then rename
    out = path.with_name(path.name + {"mp4v": ".mp4", "MJPG": ".avi", "VP80": ".webm"}[fourcc])
    writer = cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*fourcc), fps, (w, h))
    assert writer.isOpened(), f"OpenCV cannot write {fourcc} to {out}"
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 200, size=3)
    for i in range(frames):
        frame = np.zeros((h, w, 3), np.uint8)
        frame[:] = base
        y = (i * 5) % max(1, h - 8)
        frame[y:y + 8, :] = 255
        writer.write(frame)
    writer.release()
    out.rename(path)
    assert path.stat().st_size > 0
    return path


def make_bomb(path: str | os.PathLike) -> Path:
    """A real PNG whose pixel count exceeds ``Image.MAX_IMAGE_PIXELS * 2``: Pillow raises
    ``DecompressionBombError`` (not an OSError) on open. One flat grey plane compresses
    to ~180 KB on disk."""
    from PIL import Image

    side = int((Image.MAX_IMAGE_PIXELS * 2) ** 0.5) + 100
    Image.new("L", (side, side), 7).save(path)
    return Path(path)


def png_bytes(size=(32, 24), color=(200, 10, 10), fmt="PNG", **kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt, **kw)
    return buf.getvalue()


def noisy_jpeg(size=(64, 48)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.effect_noise(size, 60).convert("RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def animated_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    a, b = Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))
    a.save(buf, "PNG", save_all=True, append_images=[b], duration=100)
    return buf.getvalue()


def mpo() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    a, b = Image.new("RGB", (16, 16), (0, 255, 0)), Image.new("RGB", (16, 16), (9, 9, 9))
    a.save(buf, "MPO", save_all=True, append_images=[b])
    return buf.getvalue()


#: the hostile files of :func:`hostile_corpus` that are media but do not decode
BAD = {"bomb.png", "truncated.jpg", "text.jpg", "empty.png", "truncated.mp4"}
#: files that are not media at all: skipped and listed, never failures
NON_MEDIA = {"notes.txt", "README", "data.bin"}


def hostile_corpus(root: str | os.PathLike, bomb: str | os.PathLike | None = None) -> dict:
    """Good images and videos (some found only by content) beside hostile files.

    Returns ``{"good": [rel…], "bad": BAD, "non_media": NON_MEDIA, "videos": [rel…]}``.
    ``bomb``: an existing bomb file to link (building one takes a second).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    good = {
        "red.png": png_bytes(),
        "photo.jpg": noisy_jpeg(),
        "really_a_jpeg.png": noisy_jpeg((40, 30)),  # mislabelled, but Pillow reads it
        "anim.apng": animated_png(),  # animated PNG: suffix not in the old list
        "stereo.mpo": mpo(),
        "favicon.ico": png_bytes((16, 16), (1, 2, 3), "ICO"),
        "no_suffix_image": png_bytes((20, 20), (5, 200, 5)),  # found by content only
    }
    for rel, data in good.items():
        (root / rel).write_bytes(data)
    sub = root / "album.png"  # a directory named like an image
    sub.mkdir(exist_ok=True)
    (sub / "inner.png").write_bytes(png_bytes((24, 24), (0, 0, 200)))
    make_video(root / "clip.mp4", seed=1)
    make_video(root / "clip_webm_no_suffix", fourcc="VP80", seed=2)
    make_video(root / "motion.avi", fourcc="MJPG", seed=3)
    videos = ["clip.mp4", "clip_webm_no_suffix", "motion.avi"]
    # hostile
    if bomb is not None:
        os.symlink(os.path.abspath(bomb), root / "bomb.png")
    else:
        make_bomb(root / "bomb.png")
    jpeg = noisy_jpeg((96, 64))
    (root / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (root / "text.jpg").write_bytes(b"this is not a picture\n")
    (root / "empty.png").write_bytes(b"")
    clip = (root / "clip.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(clip[: len(clip) // 2])
    # not media
    (root / "notes.txt").write_text("a caption file\n")
    (root / "README").write_text("corpus of test media\n")
    (root / "data.bin").write_bytes(bytes(range(256)) * 4)
    (root / ".hidden.png").write_bytes(b"ignored: dot files are not walked")
    return {"good": sorted([*good, "album.png/inner.png", *videos]), "bad": BAD,
            "non_media": NON_MEDIA, "videos": videos}
