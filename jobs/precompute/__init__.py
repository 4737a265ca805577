"""The precompute job (``encache precompute``; ``warm --compute-missing``) as a package.

Its face is the public API (docs/api.md); the parts, one idea each:

* :mod:`.options` -- ``PrecomputeOptions`` (what decides the entries, how the engine
  runs), ``Summary``, argument checks, the engine's encoder-config stamp;
* :mod:`.identify` -- identify every file (manifest, else vLLM's hasher) and classify
  what the store holds under it;
* :mod:`.encode` -- encode what is missing: ``LocalStage`` (an in-process producer
  engine, the room budget, the store-full stop);
* :mod:`.capacity` -- the room budget of ``--over-capacity skip``, the capacity note;
* :mod:`.job` -- the flow: :func:`precompute_corpus` / :func:`precompute_files`, the
  finish (store checked, evictions, manifest).

The Ray stage is :mod:`encache.jobs.ray_precompute`.
"""

from .encode import Encoded, LocalStage, engine_store_url, media_item, nothing_fits, room_budget
from .identify import classify
from .job import Stage, precompute_corpus, precompute_files
from .options import (PrecomputeOptions, ProducerSettings, Summary, check_request_kwargs,
                      engine_encoder_config, hashing_settings, parse_engine_args,
                      validate_args)

__all__ = [
    "Encoded", "LocalStage", "PrecomputeOptions", "ProducerSettings", "Stage", "Summary",
    "check_request_kwargs", "classify", "engine_encoder_config", "engine_store_url",
    "hashing_settings", "media_item", "nothing_fits", "parse_engine_args",
    "precompute_corpus", "precompute_files", "room_budget", "validate_args",
]
