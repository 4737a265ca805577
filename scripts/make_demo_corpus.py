#!/usr/bin/env python
"""Write a small synthetic corpus of "document page" images in every common format.

    python scripts/make_demo_corpus.py OUT_DIR [--pages 24] [--seed 0] [--broken]
                                           [--size 96x128]

The generator is ``tests/demo_corpus.py`` (the tests build their corpora with it); this is
its command line, for ``scripts/demo`` and the benchmarks.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from demo_corpus import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
