import pytest

from grpolab import hardware


@pytest.mark.parametrize("flags,kind", [
    ({"fpu", "sse4_2", "avx", "avx2", "fma"}, "avx2"),
    ({"avx2", "avx512f", "avx512bw"}, "avx2"),  # AVX-512 without BF16: no native bf16
    ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx"),
    ({"fp", "asimd", "bf16"}, "arm_bf16"),
    ({"fp", "asimd"}, "other"),
    (set(), "other"),
])
def test_kind_from_flags(flags, kind):
    assert hardware.detected_cpu_kind(frozenset(flags)) == kind


@pytest.mark.parametrize("kind", hardware.CPU_KINDS)
def test_the_environment_variable_makes_auto_decide_as_that_kind(kind, monkeypatch):
    monkeypatch.setenv(hardware.CPU_KIND_ENV, kind)
    assert hardware.cpu_kind() == kind
    assert hardware.cpu_supports_bf16() == (kind in ("avx512_bf16", "amx", "arm_bf16"))
    assert f"decided as {kind}" in hardware.describe_cpu()


def test_without_the_variable_the_host_decides(monkeypatch):
    monkeypatch.delenv(hardware.CPU_KIND_ENV, raising=False)
    assert hardware.cpu_kind() == hardware.detected_cpu_kind()


def test_an_unknown_kind_is_named(monkeypatch):
    monkeypatch.setenv(hardware.CPU_KIND_ENV, "avx9000")
    with pytest.raises(ValueError, match="GRPOLAB_CPU_KIND='avx9000' is not one of avx2"):
        hardware.cpu_kind()
