"""Shared option aliases (``Annotated``), so every command spells them the same way.

Use them as parameter annotations; the default goes in the signature::

    def cmd(store: StoreOpt, json_: JsonOpt = False, model: ModelOpt = None): ...

``StoreOpt`` has no default of its own: without ``--store`` and without ``$ENCACHE_STORE``
Typer reports a usage error (exit 2).
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Annotated, Optional

import typer

STORE_ENVVAR = "ENCACHE_STORE"

STORE_HELP = ("Store URL: PATH, file://PATH, redis://host:port/db, rediss://…, unix://…, "
              "redis+cluster://host:port[,host:port…]")


def _usage_error_on_value_error(parse, value: str):
    """``parse(value)``; its ValueError becomes a usage error (exit 2) that says only
    what is wrong (Typer would prefix the message with "Value error,")."""
    try:
        return parse(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def parse_age(value: str) -> float:
    """Typer ``parser=`` for AGE options (``90s``, ``12h``, ``7d``…)."""
    from encache.connectors.store.units import parse_age

    return _usage_error_on_value_error(parse_age, value)


def parse_size(value: str) -> int:
    """Typer ``parser=`` for SIZE options (``500M``, ``50G``…)."""
    from encache.connectors.store.units import parse_size

    return _usage_error_on_value_error(parse_size, value)


def parse_json(text: str):
    """``text`` as strict JSON: ``NaN``, ``Infinity`` and numbers beyond a float (``1e999``)
    are errors here, not a traceback later (vLLM's hasher and ``--json`` output reject
    them). Raises ValueError with a one-line message."""
    import json
    import math

    def constant(name: str):
        raise ValueError(f"{name} is not allowed")

    def number(s: str) -> float:
        x = float(s)
        if not math.isfinite(x):
            raise ValueError(f"{s} is out of range")
        return x

    try:
        return json.loads(text, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as e:
        raise ValueError(e.msg) from None


def not_negative(value: float | None) -> float | None:
    """Typer ``callback=`` for seconds and other amounts: a finite number, 0 or more (NaN,
    inf or a negative wait is meaningless, and NaN passes Typer's own ``min=``); else a
    usage error (exit 2)."""
    import math

    if value is not None and not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"{value} is not a finite number, 0 or more")
    return value


def not_empty(value: str | None) -> str | None:
    """Typer ``callback=`` for names (``--model``, ``--lora``): an empty one matches no entry,
    so a filter or a repair given one would act on the wrong set; a usage error (exit 2)."""
    if value is not None and not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


#: upper bound of ``-j N`` (processes or threads): a typo'd huge N must not start that many
#: (64, or 4 per CPU on bigger machines)
MAX_JOBS = max(64, 4 * (os.cpu_count() or 1))


LocalTierOpt = Annotated[Optional[str], typer.Option(
    "--local-tier", metavar="DIR",
    help="A directory on this node's disk in front of the shared --store (docs/local-tier.md).")]
LocalTierMaxOpt = Annotated[Optional[int], typer.Option(
    "--local-tier-max-bytes", metavar="SIZE", parser=parse_size,
    help="The local tier's capacity (500M, 50G…); least recently used copies go first.")]

# -- the producer engine's options (precompute; warm --compute-missing) -------------------
MaxModelLenOpt = Annotated[Optional[int], typer.Option(
    "--max-model-len", metavar="N", min=1, help="Engine max_model_len.")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="Engine dtype (auto, float16, bfloat16, float32).")]
EngineArgOpt = Annotated[Optional[list[str]], typer.Option(
    "--engine-arg", metavar="KEY=VALUE",
    help="Extra vllm.LLM argument (JSON value); repeatable.")]
LoraPathOpt = Annotated[Optional[str], typer.Option(
    "--lora-path", metavar="PATH",
    help="LoRA adapter to load in the producer (tower-connector LoRA).")]

StoreOpt = Annotated[str, typer.Option(
    "--store", "-s", envvar=STORE_ENVVAR, show_envvar=True, metavar="URL", help=STORE_HELP,
    callback=not_empty)]

#: the same option where a store is optional (``encache hash``: "is it in the store?")
OptionalStoreOpt = Annotated[Optional[str], typer.Option(
    "--store", "-s", envvar=STORE_ENVVAR, show_envvar=True, metavar="URL", help=STORE_HELP,
    callback=not_empty)]

JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Machine-readable JSON on stdout (raw bytes, epoch seconds).")]

YesOpt = Annotated[bool, typer.Option(
    "--yes", "-y", help="Do not ask for confirmation (needed when not on a terminal).")]

DryRunOpt = Annotated[bool, typer.Option(
    "--dry-run", "-n", help="Show what would be done, change nothing.")]

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="MODEL", callback=not_empty,
    help="Model id exactly as given to `vllm serve --model`.")]

LoraOpt = Annotated[Optional[str], typer.Option(
    "--lora", metavar="NAME", callback=not_empty,
    help="LoRA adapter name (identifiers NAME:<hash>).")]

TagOpt = Annotated[Optional[str], typer.Option(
    "--tag", help="Label entered into the encoder-config stamp (connector setting 'tag'): bump "
    "it when the weights change in place, so old entries stop matching.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="Print less: no progress, no summary.")]

OlderThanOpt = Annotated[Optional[float], typer.Option(
    "--older-than", metavar="AGE", parser=parse_age,
    help="Entries not written or read for AGE (90s, 30m, 12h, 7d, 2w).")]

LimitOpt = Annotated[Optional[int], typer.Option(
    "--limit", min=1, metavar="N", help="At most N rows.")]


class GroupBy(str, Enum):
    model = "model"
    lora = "lora"


ByOpt = Annotated[Optional[GroupBy], typer.Option(
    "--by", help="Break the total down by model or by LoRA.", case_sensitive=False)]
