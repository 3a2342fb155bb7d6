#!/usr/bin/env bash
# Twenty-first session, first device call (tests/gpu/make_carry.sh builds the carry; carry .gguf/smol.gguf.part.0,
# .gguf/sha256.txt, .whl; the shipped head's model.safetensors moved out of the working tree for the call, or
# the copy passes 64 MiB): GGUF part 0 to /tmp/models, gguf + treecompile installed. Short on purpose: the next call (session27b.sh) must follow
# within the machine's 30 s idle release.
set -u
mkdir -p /tmp/models && cp .gguf/smol.gguf.part.* .gguf/sha256.txt /tmp/models/ 2>/dev/null
bash tests/gpu/install.sh || exit 3
ls -la /tmp/models; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
