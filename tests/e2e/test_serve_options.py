"""vLLM's spelling of serve options resolves to what pagedserve runs (pure config objects)."""

from __future__ import annotations

import json
import subprocess
import sys

from pathlib import Path

import pytest

from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.runtime import cpu_dtype, options
from pagedserve.deploy.entry_points import arguments_of


@pytest.fixture
def model_dir(tmp_path):
    def make(dtype):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                          "max_position_embeddings": 128, "dtype": dtype}))
        return str(tmp_path)
    return make


@pytest.mark.parametrize("requested, config_dtype, device, expected", [
    ("auto", "float32", "cpu", "float32"),
    ("auto", "float16", "cuda", "float16"),
    ("auto", "bfloat16", "cuda", "bfloat16"),
    ("half", "float32", "cpu", "float16"),
    ("float", "bfloat16", "cpu", "float32"),
    ("bfloat16", "float32", "cpu", "bfloat16"),
])
def test_dtype_names_resolve_as_vllm_does(model_dir, requested, config_dtype, device, expected):
    assert ServeConfig(model=model_dir(config_dtype), dtype=requested, device=device).dtype == expected


@pytest.mark.parametrize("config_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("isa, expected", [("AMX-BF16", "bfloat16"), ("AVX512-BF16", "bfloat16"), (None, "float32")])
def test_a_half_precision_checkpoint_on_cpu_computes_in_bfloat16_only_where_the_cpu_multiplies_it(
        model_dir, monkeypatch, config_dtype, isa, expected):
    # vLLM's CPU rule (float16 becomes bfloat16) where the CPU has bfloat16 arithmetic; without it
    # torch's bfloat16 is 2-6x slower than float32 (AVX2), so auto computes in float32 there
    monkeypatch.setattr(cpu_dtype, "fast_bfloat16_matmuls", lambda: isa)
    assert ServeConfig(model=model_dir(config_dtype), dtype="auto", device="cpu").dtype == expected


SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ZEN5 = {"avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
SKYLAKE_SP = {"avx2", "avx512f", "avx512bw", "avx512vl"}  # oneDNN emulates bfloat16: float32's rate
ZEN1 = {"avx2", "fma"}


@pytest.mark.parametrize("flags, isa, dtype", [
    (SAPPHIRE_RAPIDS, "AMX-BF16", "bfloat16"),
    (ZEN5, "AVX512-BF16", "bfloat16"),
    (SKYLAKE_SP, None, "float32"),
    (ZEN1, None, "float32"),
    (set(), None, "float32"),  # no /proc/cpuinfo
    ({"amx_bf16"}, None, "float32"),  # tiles named without the tile state: not usable
])
def test_the_auto_dtype_of_a_bfloat16_checkpoint_follows_the_cpus_bfloat16_flags(flags, isa, dtype):
    assert cpu_dtype.bfloat16_isa(frozenset(flags)) == isa
    chosen, why = cpu_dtype.choose_cpu_dtype("bfloat16", cpu_dtype.bfloat16_isa(frozenset(flags)), 2**30, 16 * 2**30)
    assert chosen == dtype and (isa or "no AMX or AVX512-BF16") in why


def test_cpu_flags_are_read_from_cpuinfo_and_missing_is_empty(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_dtype.cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_dtype.cpu_flags(str(tmp_path / "absent")) == frozenset()


def test_a_float32_checkpoint_stays_float32_on_a_cpu_with_bfloat16_arithmetic(model_dir, monkeypatch):
    monkeypatch.setattr(cpu_dtype, "fast_bfloat16_matmuls", lambda: "AMX-BF16")  # as vLLM: the config's dtype
    assert ServeConfig(model=model_dir("float32"), dtype="auto", device="cpu").dtype == "float32"


def test_this_cpus_answer_is_the_one_its_flags_and_torch_give(model_dir):
    isa = cpu_dtype.fast_bfloat16_matmuls()
    assert isa in (None, cpu_dtype.bfloat16_isa(cpu_dtype.cpu_flags()))
    expected = "bfloat16" if isa else "float32"
    assert ServeConfig(model=model_dir("bfloat16"), dtype="auto", device="cpu").dtype == expected


@pytest.mark.parametrize("fast, float32_gib, available_gib, expected", [
    (None, 2.0, 16.0, "float32"),
    (None, 8.0, 16.0, "float32"),  # exactly half: still fits
    (None, 8.1, 16.0, "bfloat16"),  # a 7B on a 32 GB laptop: too big in float32, slow but it fits
    ("AVX512-BF16", 0.1, 16.0, "bfloat16"),
])
def test_float32_is_chosen_only_where_its_weights_fit_half_the_available_memory(fast, float32_gib, available_gib,
                                                                                expected):
    dtype, why = cpu_dtype.choose_cpu_dtype("bfloat16", fast, int(float32_gib * 2**30), int(available_gib * 2**30))
    assert dtype == expected
    assert ("float32" if expected == "float32" else "bfloat16") in why


def test_replicas_on_one_host_each_count_their_float32_copy(model_dir, monkeypatch, tmp_path):
    import psutil

    path = model_dir("bfloat16")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)  # 2000 bytes a copy in float32
    monkeypatch.setattr(cpu_dtype, "fast_bfloat16_matmuls", lambda: None)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": 7000})())
    assert ServeConfig(model=path, dtype="auto", device="cpu").dtype == "float32"  # 2000 <= 3500
    assert ServeConfig(model=path, dtype="auto", device="cpu", data_parallel_size=2).dtype == "bfloat16"  # 4000


def test_served_model_names_go_to_the_frontend_and_the_first_is_the_response_name(model_dir):
    cfg = ServeConfig(model=model_dir("float32"), served_model_name=["a", "b"])
    cmd = cfg.frontend_cmd("/tmp/run")
    at = cmd.index("--served-model-name")
    assert cmd[at + 1:at + 3] == ["a", "b"]


def test_the_model_path_as_given_is_an_accepted_name_unless_names_are_set(model_dir):
    from pagedserve.frontend_proc.args import parse_args

    path = model_dir("float32")  # vLLM serves `vllm serve /models/x` as "/models/x"
    frontend = parse_args(arguments_of(ServeConfig(model=path).frontend_cmd("/tmp/run")))
    assert frontend.served_model_names == (Path(path).name,) and frontend.model_aliases == (path,)
    named = parse_args(arguments_of(ServeConfig(model=path, served_model_name=["a"]).frontend_cmd("/tmp/run")))
    assert named.served_model_names == ("a",) and named.model_aliases == ()


def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="chat-template"):
        ServeConfig(model=model_dir("float32"), chat_template="no-such-file.jinja")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ServeConfig(model=model_dir("float32"), chat_template=str(template)).chat_template == str(template)


def test_tool_calling_flags_reach_the_frontend_and_an_unknown_parser_is_refused(model_dir):
    from pagedserve.runtime.options import TOOL_CALL_PARSERS
    from pagedserve.frontend_proc.args import parse_args
    from pagedserve.frontend_proc.tool_parsers import TOOL_PARSERS

    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)  # deploy cannot import the frontend
    cfg = ServeConfig(model=model_dir("float32"), enable_auto_tool_choice=True, tool_call_parser="hermes")
    frontend = parse_args(arguments_of(cfg.frontend_cmd("/tmp/run"))).tool_calling
    assert (frontend.enable_auto_tool_choice, frontend.tool_call_parser) == (True, "hermes")
    with pytest.raises(ConfigError, match="hermes, llama3_json"):
        ServeConfig(model=model_dir("float32"), tool_call_parser="granite")
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ServeConfig(model=model_dir("float32"), enable_auto_tool_choice=True)


def test_the_device_defaults_to_what_torch_sees_and_sets_the_step_budget(model_dir, monkeypatch, tmp_path):
    import torch

    # a GPU driver shows, so auto asks torch
    monkeypatch.setattr(options, "GPU_DEVICE_PATTERNS", (str(tmp_path / "config.json"),))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ServeConfig(model=model_dir("float32")).device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = ServeConfig(model=model_dir("float32"))
    assert (cpu.device, cpu.max_num_batched_tokens) == ("cpu", 1024)  # a CPU step grows with its tokens
    argv = cpu.scheduler_cmd("/tmp/run", 0)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "1024"  # the scheduler gets the resolved budget
    cuda = ServeConfig(model=model_dir("float32"), device="cuda")
    assert cuda.max_num_batched_tokens == 8192  # a GPU step's host cost hardly grows with its tokens
    assert ServeConfig(model=model_dir("float32"), device="cuda", max_num_batched_tokens=512).max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match="--device"):
        ServeConfig(model=model_dir("float32"), device="tpu")


@pytest.mark.slow  # a fresh interpreter
def test_without_a_gpu_driver_auto_is_cpu_without_importing_torch(model_dir, monkeypatch, tmp_path):
    # `serve` resolves the device before it spawns anything: importing torch there cost every
    # start 1.5-3 s. The check runs in a fresh interpreter, where nothing imported torch yet.
    monkeypatch.setattr(options, "GPU_DEVICE_PATTERNS", (str(tmp_path / "no-such-driver*"),))
    assert ServeConfig(model=model_dir("float32")).device == "cpu"
    code = ("import sys; from pagedserve.runtime import options; "
            f"options.GPU_DEVICE_PATTERNS = ({str(tmp_path / 'none*')!r},); "
            "from pagedserve.deploy.serve_config import ServeConfig; "
            f"print(ServeConfig(model={model_dir('float32')!r}).device, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["cpu", "False"]
