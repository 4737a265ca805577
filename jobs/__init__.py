"""Jobs as library code: functions that run a whole encache job and return its summary.

The CLI parses options and renders what these return. ``precompute`` (a package: over a
corpus or a list of files; its parts ``options``, ``identify``, ``encode``, ``job``),
``warm`` (the whole warm job), ``ray_precompute`` (the precompute job's Ray stage),
``ray_cluster`` (connecting, the every-node check) and ``progress`` (the one progress
protocol they report to). See docs/api.md.
"""
