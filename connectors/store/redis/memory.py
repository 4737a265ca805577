"""Is a Redis server set up to be a cache? ``maxmemory`` and its eviction policy.

A Redis that holds encache entries must be bounded (``maxmemory``) and must evict by
itself (``allkeys-lru`` / ``allkeys-lfu``); otherwise it grows until the host runs out of
memory or refuses every new entry (OOM) once full. ``encache stats``/``info`` show these
warnings; the cluster store asks every primary. The settings come from ``INFO memory``,
else ``CONFIG GET`` (managed services may rename either away).
"""

from __future__ import annotations

import contextlib

RECOMMENDED_POLICIES = ("allkeys-lru", "allkeys-lfu")
TTL_POLICIES = ("volatile-lru", "volatile-lfu", "volatile-ttl")


def memory_info(client, errors: tuple, **node) -> dict:
    """``maxmemory``/``maxmemory_policy``/``used_memory`` from INFO, else CONFIG GET
    (``node``: ``target_nodes=`` for one cluster node); ``errors`` are swallowed."""
    mem: dict = {}
    with contextlib.suppress(*errors):
        mem = dict(client.info("memory", **node))
    if "maxmemory" not in mem or "maxmemory_policy" not in mem:
        with contextlib.suppress(*errors):  # CONFIG may be renamed away (managed Redis)
            cfg = client.config_get("maxmemory*", **node)
            if "maxmemory" in cfg:
                mem.setdefault("maxmemory", int(cfg["maxmemory"]))
            if "maxmemory-policy" in cfg:
                mem.setdefault("maxmemory_policy", cfg["maxmemory-policy"])
    return mem


def memory_warnings(mem: dict, ttl: float | None) -> list[str]:
    """What is wrong with one server's ``maxmemory``/policy/usage for a cache whose
    entries carry ``ttl`` (None: no expiry)."""
    warnings = []
    maxmemory, policy = mem.get("maxmemory"), mem.get("maxmemory_policy")
    if maxmemory is None or policy is None:
        return ["could not read maxmemory / maxmemory-policy (INFO and CONFIG unavailable); "
                "make sure the server is bounded and evicts with allkeys-lru or allkeys-lfu"]
    maxmemory = int(maxmemory)
    if maxmemory == 0:
        warnings.append("maxmemory is 0 (unbounded): Redis grows until the host runs out of "
                        "memory; set maxmemory to what the cache may use (and "
                        "maxmemory-policy allkeys-lru)")
    if policy == "noeviction":
        warnings.append("maxmemory-policy is noeviction: once maxmemory is reached every "
                        "new entry fails to save (OOM); use allkeys-lru or allkeys-lfu")
    elif policy.startswith("volatile-") and not (ttl and policy in TTL_POLICIES):
        why = ("it evicts at random among them" if ttl else
               "encache entries have no TTL (ttl option unset), so nothing is evictable and "
               "writes fail with OOM when full")
        warnings.append(f"maxmemory-policy is {policy}: it only evicts keys with a TTL and "
                        f"{why}; use allkeys-lru or allkeys-lfu")
    elif policy == "allkeys-random":
        warnings.append("maxmemory-policy is allkeys-random: hot entries are evicted as "
                        "readily as cold ones; allkeys-lru or allkeys-lfu is recommended")
    used = mem.get("used_memory")
    if maxmemory and used is not None and int(used) >= 0.9 * maxmemory \
            and policy not in RECOMMENDED_POLICIES:
        warnings.append(f"Redis is at {100 * int(used) / maxmemory:.0f}% of maxmemory "
                        "and its policy will not make room")
    return warnings
