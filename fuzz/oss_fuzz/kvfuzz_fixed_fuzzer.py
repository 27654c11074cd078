"""libFuzzer target: vLLM's prefix-cache managers, variant ``fixed``.

The installed vLLM plus the seed fix.

Crashes only on findings no known vLLM issue explains (:mod:`fuzz.atheris_harness`).
"""

import sys

from fuzz.atheris_harness import main

if __name__ == "__main__":
    main(["--variants", "fixed", "--no-dense-check", *sys.argv[1:]])
