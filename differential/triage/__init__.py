"""Triage: one root cause per finding, its facets and consequences (no vLLM).

* :mod:`differential.triage.identity` -- one root cause per finding, its
  facets and consequences.

The known vLLM issues, which label findings wherever they are made (the
comparison, engine mode), are the oracle's: :mod:`differential.oracle.known`.
"""
