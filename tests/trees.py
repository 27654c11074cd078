"""Build vLLM source trees for tree-variant tests: symlink farms of the
installed vLLM package with a few files replaced by edited copies."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import vllm

INSTALLED = Path(vllm.__file__).resolve().parent

SPECULATIVE = "config/speculative.py"
SINGLE_TYPE = "v1/core/single_type_kv_cache_manager.py"


def make_tree(root: Path, edits: dict[str, list[tuple[str, str]]] | None = None) -> Path:
    """A folder holding a ``vllm`` package: the installed one, with ``edits``
    (relative file -> [(old, new)] text replacements, each exactly once)."""
    root.mkdir(parents=True, exist_ok=True)
    if not edits:
        (root / "vllm").symlink_to(INSTALLED)
        return root
    subprocess.run(["cp", "-rs", str(INSTALLED), str(root / "vllm")], check=True)
    for relative, replacements in edits.items():
        target = root / "vllm" / relative
        text = (INSTALLED / relative).read_text()
        for old, new in replacements:
            assert text.count(old) >= 1, (relative, old)
            text = text.replace(old, new, 1)
        target.unlink()
        target.write_text(text)
    return root


# The seed PR's fix, applied by hand to the tree's source (the same rules as
# differential/driver/fixes.py): no drop for Gemma-4 MTP; each periodic SWA
# tail A / B_swa blocks wider under the drop with sparse retention.
SEED_FIX = {
    SPECULATIVE: [
        (
            "return self.use_eagle() and not (self.use_dflash() or self.use_dspark())",
            "return self.use_eagle() and not (\n"
            "            self.use_dflash() or self.use_dspark() or self.use_gemma4_mtp()\n"
            "        )",
        )
    ],
    SINGLE_TYPE: [
        (
            "            per_segment = segment_tokens // block_size\n"
            "            if need >= per_segment:",
            "            per_segment = segment_tokens // block_size\n"
            "            tail = need + (\n"
            "                alignment_tokens // block_size\n"
            "                if use_eagle and retention_interval\n"
            "                and retention_interval != alignment_tokens\n"
            "                else 0\n"
            "            )\n"
            "            if tail >= per_segment:",
        ),
        (
            "(i - shift) % per_segment >= per_segment - need:",
            "(i - shift) % per_segment >= per_segment - tail:",
        ),
    ],
}

BROKEN_MASK = {
    SINGLE_TYPE: [
        (
            "        assert isinstance(kv_cache_spec, SlidingWindowSpec)\n"
            "        if alignment_tokens is None:",
            '        raise RuntimeError("broken reachable_block_mask")\n'
            "        if alignment_tokens is None:",
        )
    ]
}

HANGING_LOOKUP = {
    SINGLE_TYPE: [
        (
            "        assert isinstance(kv_cache_spec, SlidingWindowSpec), (\n"
            '            "SlidingWindowManager can only be used for sliding window groups"\n'
            "        )",
            "        import time\n\n        time.sleep(10**6)",
        )
    ]
}


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


BLOCK_POOL = "v1/core/block_pool.py"

# vLLM works as before, but the attribute kvfuzz's driver reads to count the
# cached blocks (BlockHashToBlockMap._cache) is renamed: the driver fails, not vLLM.
RENAMED_BLOCK_CACHE = {
    BLOCK_POOL: [("self._cache", "self._blocks_by_key")]
    * (INSTALLED / BLOCK_POOL).read_text().count("self._cache")
}

INIT = "__init__.py"

# vLLM raises on import, with its own message.
RAISING_IMPORT = {
    INIT: [
        (
            "# SPDX-License-Identifier: Apache-2.0\n",
            "# SPDX-License-Identifier: Apache-2.0\n"
            'raise RuntimeError("this vLLM build refuses to import: no libcudart")\n',
        )
    ]
}

# vLLM prints a banner on stdout at import, from Python and from a C-level write.
BANNER = {
    INIT: [
        (
            "# SPDX-License-Identifier: Apache-2.0\n",
            "# SPDX-License-Identifier: Apache-2.0\n"
            "import os as _os\n"
            'print("Welcome to vLLM! {not json")\n'
            '_os.write(1, b"raw banner line\\n")\n',
        )
    ]
}

# vLLM hangs on import.
HANGING_IMPORT = {
    INIT: [
        (
            "# SPDX-License-Identifier: Apache-2.0\n",
            "# SPDX-License-Identifier: Apache-2.0\nimport time as _time\n\n_time.sleep(10**6)\n",
        )
    ]
}

# vLLM imports slowly but surely: two CPU-seconds of work before the rest of
# its __init__ (a loaded machine stretches that in wall time, it never stops it).
SLOW_IMPORT = {
    INIT: [
        (
            "# SPDX-License-Identifier: Apache-2.0\n",
            "# SPDX-License-Identifier: Apache-2.0\n"
            "import time as _time\n\n"
            "_until = _time.process_time() + 2.0\n"
            "while _time.process_time() < _until:\n"
            "    pass\n",
        )
    ]
}

# The one-line breakage of SlidingWindowManager.find_longest_cache_hit: a run of
# one block fewer than the window needs counts as a hit (vLLM serves KV blocks
# the window reads as the null block).
SHORT_WINDOW_RUN = {
    SINGLE_TYPE: [
        (
            "if num_contiguous_blocks >= sliding_window_contiguous_blocks:",
            "if num_contiguous_blocks >= sliding_window_contiguous_blocks - 1:",
        )
    ]
}

# A change that changes nothing: a comment.
COMMENT_ONLY = {
    "v1/core/kv_cache_utils.py": [
        (
            "# SPDX-License-Identifier: Apache-2.0\n",
            "# SPDX-License-Identifier: Apache-2.0\n# A comment a pull request adds.\n",
        )
    ]
}


def commit_edits(
    repo: Path, branch: str, edits: dict[str, list[tuple[str, str]]], *, start: str = "main"
) -> None:
    """A new branch of the git repository ``repo`` (a :func:`make_tree` farm
    committed) from ``start``, with ``edits`` committed on it; the working
    tree is left on ``start``."""
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "checkout", "-q", "-b", branch, start], check=True)
    for relative, replacements in edits.items():
        target = repo / "vllm" / relative
        text = target.read_text()
        for old, new in replacements:
            assert text.count(old) >= 1, (relative, old)
            text = text.replace(old, new, 1)
        target.unlink()
        target.write_text(text)
    subprocess.run([*git, "commit", "-q", "-am", branch], check=True)
    subprocess.run([*git, "checkout", "-q", start], check=True)
