"""bench/common.py helpers that the bench reports print."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import cpu_description  # noqa: E402

_CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_cpu_description_names_the_model_and_its_bf16_matrix_instructions():
    assert cpu_description(_CPUINFO) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (amx_bf16, avx512_bf16; avx512f)"
    avx2_only = _CPUINFO.replace("avx512f avx512_bf16 amx_bf16", "avx2")
    assert cpu_description(avx2_only).endswith("(no bf16 matrix instructions; avx2)")
    assert cpu_description(_CPUINFO.replace("avx512f avx512_bf16 amx_bf16", "")).endswith("(no bf16 matrix instructions)")


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="no /proc/cpuinfo (not Linux)")
def test_cpu_description_reads_this_machine_s_cpuinfo_by_default():
    assert cpu_description() == cpu_description(Path("/proc/cpuinfo").read_text())
