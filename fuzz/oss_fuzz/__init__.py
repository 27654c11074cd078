"""Fuzzer entry points named as ClusterFuzzLite / OSS-Fuzz expect (``*_fuzzer.py``)."""
