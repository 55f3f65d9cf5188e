"""llama.cpp's ``llama-server`` as a bench peer: built here from the source that the
llama-cpp-python sdist carries (``vendor/llama.cpp``), never a dependency of pagedserve.

Everything lives under ``$PAGEDSERVE_LLAMACPP_DIR`` (default ``~/.cache/pagedserve/llama.cpp``):
- ``sdist/``: ``pip download --no-deps --no-binary :all: llama-cpp-python``;
- ``src/``: the sdist unpacked; ``src/vendor/llama.cpp/build/bin/`` holds ``llama-server`` and
  ``llama-quantize``, built with cmake for this CPU (``GGML_NATIVE``, about 10 minutes on 2 cores);
- ``gguf/<model dir name>-<hash of its files>/<type>.gguf``: a model converted by llama.cpp's own
  ``convert_hf_to_gguf.py`` (f32, f16, bf16, q8_0), or quantized from its bf16 file by
  ``llama-quantize`` (q4_k_m, q6_k, q4_0, ...).

The bench models' tokenizers are random BPEs whose pre-tokenizer hash the converter does not know;
it refuses them. The bench sends token-id prompts, so the pre-tokenizer never runs: the converter
is run with ``get_vocab_base_pre`` answering "gpt-2" (a byte-level BPE, as ours is), the one
change made to it, in this process's copy of the module only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMACPP_DIR_ENV = "PAGEDSERVE_LLAMACPP_DIR"
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # written by convert_hf_to_gguf.py itself
SERVER = "llama-server"
QUANTIZE = "llama-quantize"

_CONVERT = """
import sys
src = sys.argv.pop(1)
sys.path[:0] = [src + "/gguf-py", src]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # token-id prompts: see bench/llamacpp.py
import convert_hf_to_gguf
sys.argv[0] = "convert_hf_to_gguf.py"
convert_hf_to_gguf.main()
"""


def home() -> Path:
    return Path(os.environ.get(LLAMACPP_DIR_ENV) or Path.home() / ".cache" / "pagedserve" / "llama.cpp")


def source_dir() -> Path:
    return home() / "src" / "vendor" / "llama.cpp"


def bin_dir() -> Path:
    return source_dir() / "build" / "bin"


def _run(cmd: list, what: str, **kwargs) -> None:
    print(f"llama.cpp: {what}", flush=True)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp: {what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")


def ensure_built() -> Path:
    """The directory holding llama-server and llama-quantize, downloaded and built if missing."""
    if (bin_dir() / SERVER).exists() and (bin_dir() / QUANTIZE).exists():
        return bin_dir()
    if shutil.which("cmake") is None:
        raise SystemExit("llama.cpp: building llama-server needs cmake and a C++ compiler (apt-get install cmake g++)")
    sdist = home() / "sdist"
    archives = sorted(sdist.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        sdist.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", sdist,
              "llama-cpp-python"], "downloading the llama-cpp-python sdist")
        archives = sorted(sdist.glob("llama_cpp_python-*.tar.gz"))
    if not source_dir().is_dir():
        src = home() / "src"
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(archives[-1]) as tar:
            top = tar.getnames()[0].split("/")[0]
            tar.extractall(home(), filter="data")
        (home() / top).rename(src)
    build = source_dir() / "build"
    _run(["cmake", "-S", source_dir(), "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"],
         "configuring (cmake)")
    _run(["cmake", "--build", build, "-j", str(os.cpu_count() or 1), "--target", SERVER, QUANTIZE],
         f"building {SERVER} and {QUANTIZE} for this CPU (minutes)")
    return bin_dir()


def gguf_dir(model_dir: Path) -> Path:
    """Where ``model_dir``'s GGUF files go: named by its config and weight files (name, size,
    mtime), so that a new model written at the same path is converted anew."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors"))
    key = hashlib.sha256(repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode())
    return home() / "gguf" / f"{model_dir.name}-{key.hexdigest()[:12]}"


def ensure_gguf(model_dir: str | Path, gguf_type: str) -> Path:
    """``model_dir`` as a GGUF file of ``gguf_type`` (lower case, as llama.cpp names them), made once."""
    model_dir = Path(model_dir)
    gguf_type = gguf_type.lower()
    out = gguf_dir(model_dir) / f"{gguf_type}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    if gguf_type in CONVERTER_TYPES:
        _run([sys.executable, "-c", _CONVERT, source_dir(), model_dir, "--outtype", gguf_type, "--outfile", partial],
             f"converting {model_dir.name} to {gguf_type} (convert_hf_to_gguf.py)",
             env={**os.environ, "NO_LOCAL_GGUF": ""})
    else:
        base = ensure_gguf(model_dir, "bf16")
        _run([ensure_built() / QUANTIZE, base, partial, gguf_type.upper()],
             f"quantizing {model_dir.name} to {gguf_type} (llama-quantize)")
    partial.rename(out)
    return out


def server_command(gguf: Path, port: int, parallel: int, context_per_slot: int,
                   threads: int | None = None) -> list[str]:
    """llama-server with ``parallel`` slots of ``context_per_slot`` tokens each, on every core
    (``threads``), continuous batching (its default); the web UI off."""
    threads = threads or os.cpu_count() or 1
    return [str(ensure_built() / SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * context_per_slot),
            "--no-webui"]
