"""The persistent compile cache, and what a compilation is estimated to cost.

torch.compile keeps its compiled graphs (inductor's FX graph cache and AOTAutograd's cache, both on in
torch ≥ 2.6) under TORCHINDUCTOR_CACHE_DIR, by default a folder in /tmp that a reboot empties.
`use_persistent_cache` points it at `$GRPOLAB_CACHE/inductor` (default ~/.cache/grpolab/inductor)
unless the user set it, so a later run of the same model loads its graphs instead of compiling them.

The compile rule (`speed.compile_pays`) takes the cold cost whether or not the cache holds the graphs:
a decision that depends on the cache's state would differ between a run and its resumption, and a
resumed run must compute what the original would have.
"""

from __future__ import annotations

import os

COLD_COMPILE_S = 90.0
"""Seconds a cold compile adds to a run on a 2-core CPU: the bench fixture's first step took 77 s with
its blocks compiled (float32, AVX2; 21 s from the persistent cache) and 101 s with the whole model and
the decode step compiled (bf16, AVX512-BF16). Regional compilation keeps deeper models near one
block's time."""


def use_persistent_cache() -> str:
    """Points torch's compile caches at `$GRPOLAB_CACHE/inductor` unless TORCHINDUCTOR_CACHE_DIR is set;
    returns the folder in use."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from grpolab.models.loading import cache_root

        path = cache_root() / "inductor"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
