"""Jobs as library code: functions that run a whole encache job and return its summary.

The CLI parses options and renders what these return. ``ray_precompute`` is the first
job here; the single-host precompute (``encache.cli.precompute.run_precompute``) moves
next to it with the job-API refactor (issue #12).
"""
