#!/usr/bin/env bash
# Fills .whl/ with what a lent GPU machine lacks (its image has torch, triton, transformers,
# tokenizers, numpy, psutil, prometheus-client, httpx, ...; see /work/.library/device/KINDS.md),
# for Python 3.12 there, plus pagedserve's own wheel built from this checkout. Run here, then
# call the device tool with carry [".whl"] and `bash bench/gpu_session.sh STEP...`.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  annotated_doc==0.0.7 apache_tvm_ffi==0.1.15.post2 annotated_types==0.8.0 distro==1.9.0 fastapi==0.165.0 httpcore2==2.16.2 httptools==0.9.0 httpx2==2.16.2 jiter==0.19.0 msgspec==0.22.0 openai==3.57.0 opentelemetry_api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing_inspection==0.4.5 uvicorn==0.54.0 xgrammar==0.2.8 
rm -f .whl/pagedserve-*.whl
# A stale egg-info's SOURCES.txt (or build/) puts files in the wheel that pyproject no longer
# lists, which hid a missing package once (bench/log/2026-11-28.md "GPU: paged attention's tiles").
rm -rf build pagedserve.egg-info
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python  # it has setuptools; a bare python3 may not
$python -m pip wheel -q --no-deps --no-build-isolation -w .whl .
