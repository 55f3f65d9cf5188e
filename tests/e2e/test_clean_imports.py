"""Every process pagedserve starts imports what is installed, never its working directory: from a
directory that shadows an installed package (a clone's root, whose kernels/ is the name of the
package transformers imports to read a Llama config), a deployment serves a Llama at
transformers' greedy tokens, through ``pagedserve serve``, a shared listening fork server and the
offline ``LLM``. The Ray path is checked in test_ray_backend.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import psutil
import pytest

from support.greedy import assert_equal_to_transformers, greedy_completions
from support.oracle import hf_greedy, hf_tokenizer
from support.server import Server, pagedserve_processes
from support.shadowing import assert_it_shadows, environ, shadowing_cwd, unsafe_env
from pagedserve.deploy.fork_client import ADDRESS_ENV, ForkServerConnection

pytestmark = pytest.mark.slow

ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "256"]
PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def llama(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def cwd(tmp_path_factory):
    where = shadowing_cwd(tmp_path_factory.mktemp("shadow"))
    assert_it_shadows(where)
    return where


def test_pagedserve_serve_from_a_shadowing_directory_serves_a_llama_at_transformers_parity(llama, cwd, tmp_path):
    srv = Server(llama, ARGS, env=unsafe_env(), cwd=str(cwd), console_script=True, own_fork_server=True)
    srv.start(tmp_path)
    try:
        prompts = [hf_tokenizer(llama)(p).input_ids for p in PROMPTS]
        assert_equal_to_transformers(llama, prompts, greedy_completions(srv, prompts, 8), 8)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.log()


def test_a_listening_fork_server_started_there_forks_a_deployment_that_serves(llama, cwd, tmp_path, monkeypatch):
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("PYTHONSAFEPATH")
    owner = ForkServerConnection(listen=os.path.join(tempfile.mkdtemp(prefix="pfs-"), "fork.sock"))
    monkeypatch.undo()
    srv = Server(llama, ARGS, env=unsafe_env(**{ADDRESS_ENV: owner.address}), cwd=str(cwd))
    try:
        srv.start(tmp_path)
        forked = [p for p in pagedserve_processes(srv.run_dir_parent) if p.ppid() == owner.proc.pid]
        assert len(forked) == 3, srv.log()  # the scheduler, the worker and the frontend
        prompts = [hf_tokenizer(llama)(p).input_ids for p in PROMPTS]
        assert_equal_to_transformers(llama, prompts, greedy_completions(srv, prompts, 8), 8)
    finally:
        srv.stop()
        owner.close()
        os.rmdir(os.path.dirname(owner.address))


def test_the_offline_llm_run_there_generates_transformers_greedy_tokens(llama, cwd, tmp_path):
    script = tmp_path / "offline.py"  # the user's script lives elsewhere; only the working directory shadows
    script.write_text(textwrap.dedent(f"""
        import json
        from pagedserve import LLM, SamplingParams
        with LLM({str(llama)!r}, num_gpu_blocks=64, max_model_len=256) as llm:
            outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True), use_tqdm=False)
        print(json.dumps([o.outputs[0].token_ids for o in outs]))
    """))
    run = subprocess.run([sys.executable, str(script)], cwd=cwd, env=environ(unsafe_env()), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == [hf_greedy(str(llama), [5, 6, 7, 8], 8), hf_greedy(str(llama), [9, 10, 11], 8)]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(llama) in " ".join(p.info["cmdline"] or [])
                and "pagedserve" in " ".join(p.info["cmdline"] or [])]
