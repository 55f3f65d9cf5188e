"""The native CPU kernels as built for each x86-64 level (kernels/cpu_native.py ``_build(march)``):
a test that takes the ``variant`` fixture runs once per variant this CPU can execute, so the AVX2
and scalar code that other machines get is tested here too."""

from __future__ import annotations

import platform

import pytest

from pagedserve.kernels import cpu_native

# -march, the variant it builds, and the /proc/cpuinfo flags a CPU needs to run it
MARCHES = {
    "native": (None, ()),
    "x86-64-v4": ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")),
    "x86-64-v3": ("avx2", ("avx2", "fma", "f16c", "bmi2", "movbe")),
    "x86-64": ("scalar", ()),
}
_built: dict = {}


@pytest.fixture(params=[m if m == "native" else pytest.param(m, marks=pytest.mark.slow) for m in MARCHES])
def variant(request, monkeypatch):
    """The kernels as built for one -march, in place of this CPU's own for the test (another
    -march runs the compiler: slow)."""
    march = request.param
    expected, needed = MARCHES[march]
    if march != "native":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip(f"-march={march} is an x86-64 level; this is {platform.machine()}")
        missing = [flag for flag in needed if flag not in cpu_native._cpu_flags().split()]
        if missing:
            pytest.skip(f"this CPU cannot run the {expected} variant: no {', '.join(missing)}")
    if march not in _built:
        _built[march] = cpu_native.library() if march == "native" else cpu_native._build(march)
    lib = _built[march]
    if lib is None:
        pytest.skip(f"the kernels did not build with -march={march}")
    name = lib.cpu_kernel_variant().decode()
    assert name == expected or (expected is None and name in ("avx512bf16", "avx512", "avx2", "scalar"))
    monkeypatch.setattr(cpu_native, "library", lambda: lib)
    return name


def skip_where_linear_is_absent(variant: str) -> None:
    """The panel kernels (cpu_linear.c) need AVX2 and FMA: the scalar variant reports them absent,
    and the worker keeps oneDNN there."""
    if variant == "scalar":
        assert not cpu_native.supports_linear()
        pytest.skip("no AVX2 and FMA: the kernel is absent in this variant, the worker keeps oneDNN")
