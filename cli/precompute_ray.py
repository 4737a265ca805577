"""The ``--ray`` side of ``encache precompute``: calls the Ray job and renders its engines.

Kept out of ``cli/precompute.py`` so the single-host command imports no Ray; the job itself
is library code (:mod:`encache.jobs.ray_precompute`).
"""

from __future__ import annotations


def run(corpus: str, options, *, address: str, engines: int, gpus_per_engine: float,
        cpus_per_engine: float | None, **run_kwargs):
    from ..jobs.ray_precompute import RayOptions, precompute_on_ray

    return precompute_on_ray(corpus, options,
                             RayOptions(address=address, engines=engines,
                                        gpus_per_engine=gpus_per_engine,
                                        cpus_per_engine=cpus_per_engine), **run_kwargs)


def render_engines(summary) -> None:
    """One row per engine actor (node, processes, batches, images, images/s)."""
    if not getattr(summary, "engines", None):
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Ray engines ({summary.nodes} nodes, {summary.restarts} restarts)",
              title_justify="left")
    for col in ("engine", "node", "pids", "batches", "images", "images/s"):
        t.add_column(col, justify="right" if col in ("batches", "images", "images/s") else "left")
    for e in summary.engines:
        t.add_row(e["engine"], e["node_id"][:12], ",".join(map(str, e["pids"])),
                  str(e["batches"]), str(e["images"]), f"{e['images_per_second']:.1f}")
    Console().print(t)
