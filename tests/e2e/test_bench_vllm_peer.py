"""vLLM as a bench peer: the arguments that need no vLLM, and, where one is installed
(``PAGEDSERVE_VLLM_PYTHON``), the real offline comparison at a small scale."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pagedserve.bench.cli import bench_main
from pagedserve.bench.report import cpu_label
from pagedserve.bench.servers import VLLM_PYTHON_ENV, vllm_command, vllm_env

VLLM_PYTHON = os.environ.get(VLLM_PYTHON_ENV)


def run_bench(*args: str) -> int:
    return bench_main(argparse.Namespace(bench_args=list(args)))


@pytest.mark.parametrize("bench", [("offline", "--shapes", "tiny"), ("peer",)])
def test_vllm_among_the_engines_without_its_interpreter_fails_saying_how_to_name_it(bench, monkeypatch):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        run_bench(*bench, "--engines", "pagedserve,vllm")
    assert "--vllm-python" in str(exc.value) and VLLM_PYTHON_ENV in str(exc.value)


@pytest.mark.parametrize("bench", [("offline", "--shapes", "tiny"), ("peer",)])
def test_a_vllm_interpreter_that_is_not_there_and_an_unknown_engine_are_refused(bench, tmp_path):
    with pytest.raises(SystemExit, match="not an executable"):
        run_bench(*bench, "--engines", "vllm", "--vllm-python", str(tmp_path / "missing-python"))
    with pytest.raises(SystemExit, match="choose from pagedserve, vllm, transformers"):
        run_bench(*bench, "--engines", "pagedserve,sglang")


def test_vllm_serves_on_loopback_from_its_module_offline():
    cmd = vllm_command("/venv/bin/python", "/models/m", 8123, "bfloat16")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    env = vllm_env()
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"


@pytest.mark.parametrize("flags, isa", [
    ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", "AVX2 AVX-512 AVX512-BF16 AMX-BF16 AMX-INT8"),
    ("fpu avx2 avx512f avx512_bf16 avx512_vnni", "AVX2 AVX-512 AVX512-BF16, no AMX"),
    ("fpu sse4_2 avx2 fma", "AVX2, no AMX"),
])
def test_the_cpu_label_names_the_model_and_the_isa_that_sets_the_pace(tmp_path, flags, isa):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: X\ncpu family\t: 6\nmodel\t\t: 143\n"
                    f"model name\t: Some Xeon\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_label(str(info)) == f"Some Xeon (family 6 model 143), {os.cpu_count()} CPUs: {isa}"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON, reason=f"no vLLM: set {VLLM_PYTHON_ENV} to the python of vLLM's venv "
                    "(bench/README.md) to run the real comparison")
def test_offline_against_real_vllm_generates_the_same_greedy_tokens_in_float32(model_factory, tmp_path):
    # head_dim 64: vLLM's CPU attention refuses 16
    model = model_factory("qwen2", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256)
    out = tmp_path / "offline.json"
    rc = run_bench("offline", model, "--engines", "pagedserve,vllm", "--num-prompts", "4", "--input-len", "8", "24",
                   "--output-len", "8", "--runs", "1", "--dtype", "float32", "--output-json", str(out))
    assert rc == 0
    result = json.loads(out.read_text())["results"][0]
    vllm = result["rows"]["vllm"]
    assert vllm["generated_tokens"] == 32 and vllm["tokens_per_s"] > 0 and vllm["first_answer_s"] > 0
    assert result["identical_outputs"]["vllm"] == 4
    assert result["mean_common_prefix"]["vllm"] == 8
