"""libFuzzer target: vLLM's prefix-cache managers, variant ``unfixed`` (the installed vLLM as is).

Crashes only on findings no known vLLM issue explains (:mod:`fuzz.atheris_harness`).
"""

import sys

from fuzz.atheris_harness import main

if __name__ == "__main__":
    main(["--variants", "unfixed", "--no-dense-check", *sys.argv[1:]])
