"""What kvfuzz writes for people and CI (no vLLM).

* :mod:`differential.reports.table` -- the replay table and versioned JSON.
* :mod:`differential.reports.ci` -- JUnit XML, SARIF and GitHub annotations.
* :mod:`differential.reports.outputs` -- output paths, checked before work starts.
* :mod:`differential.reports.diff` -- ``kvfuzz diff``: what changed between two variants.
* :mod:`differential.reports.calibration` -- the mutation table of ``kvfuzz calibrate``.
"""
