"""Record a vLLM release's facts for tests/consumer/test_vllm_releases.py, from its wheel.

    python scripts/record_vllm_api.py vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl

(``pip download vllm==0.34.0 --no-deps`` fetches the wheel; a folder holding ``vllm/``,
such as an installed site-packages, works too.) Writes ``tests/vllm_releases/
vllm-VERSION.json`` (:func:`encache.connectors.vllm.compat.source_api`) and the release's
``v1/core/encoder_cache_manager.py`` beside it, which the tests run encache's policy
manager over. Nothing is imported from the release: only its source is read.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from encache.connectors.vllm.compat import CALLERS, SOURCES, source_api

OUT = Path(__file__).resolve().parents[1] / "tests" / "vllm_releases"


def release_version(root: Path) -> str:
    text = (root / "vllm" / "_version.py").read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"no __version__ in {root / 'vllm' / '_version.py'}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(argv[0])
    with tempfile.TemporaryDirectory() as tmp:
        if src.is_file():
            wanted = {f"vllm/{p}" for p in (*SOURCES.values(), *CALLERS, "_version.py")}
            with zipfile.ZipFile(src) as z:
                for name in z.namelist():
                    if name in wanted:
                        z.extract(name, tmp)
            root = Path(tmp)
        else:
            root = src
        version = release_version(root).split("+")[0]
        OUT.mkdir(parents=True, exist_ok=True)
        facts = {"version": version, **source_api(root)}
        (OUT / f"vllm-{version}.json").write_text(json.dumps(facts, indent=1) + "\n")
        shutil.copyfile(root / "vllm" / SOURCES["manager"],
                        OUT / f"encoder_cache_manager-{version}.py")
    print(f"recorded vLLM {version} in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
