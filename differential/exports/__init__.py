"""Reproducers a maintainer can read or run (no vLLM at import).

* :mod:`differential.exports.explain` -- ``kvfuzz explain``: the blocks each
  variant kept around one sibling's divergence, as text and SVG.
* :mod:`differential.exports.manager_test` -- ``kvfuzz export-test``: a
  standalone pytest driving vLLM's ``KVCacheManager``.
* :mod:`differential.exports.scheduler_test` -- the same for scheduler-mode
  scenarios, driving vLLM's ``Scheduler``.
"""
