"""Triage: root-cause identity, facets and known vLLM issues (no vLLM).

* :mod:`differential.triage.identity` -- one root cause per finding, its
  facets and consequences.
* :mod:`differential.triage.known` -- known vLLM issues, recognised from
  first principles.

The package itself imports nothing, so :mod:`differential.findings` can read
the known issues without importing the comparison.
"""
