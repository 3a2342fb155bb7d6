"""Registers and spills of the stage-1 cascade and top-k slice kernels for sm_90, on the CPU machine (no GPU).

    env -u TRITON_INTERPRET python3 tests/gpu/ptxas_regs.py

Compiles the cases of ``tests/ops/test_sm90_compile.py`` (16-divisibility marks as a real launch gets them) to
PTX and runs Triton's bundled ``ptxas -v`` for sm_90a on it (the PTX ``.version`` lowered to 8.8, which that
ptxas reads). The CPU machine's Triton is newer than the GPU machine's, so the counts are a guide.
"""

import os
import re
import subprocess
import sys
import tempfile

import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ops"))
import test_sm90_compile as cases_module  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def main() -> None:
    for name, case in cases_module._cases().items():
        if not name.startswith(tuple(sys.argv[1:]) or ("stage1", "topk")):
            continue
        compiled = cases_module.compile_case(*case)
        ptx = re.sub(r"\.version \d+\.\d+", ".version " + os.environ.get("PTX_VERSION", "8.8"), compiled.asm["ptx"])
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        out = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
        os.unlink(f.name)
        info = " ".join(line.strip() for line in out.stderr.splitlines() if "registers" in line or "spill" in line)
        print(f"{name:32s} {info}", flush=True)


if __name__ == "__main__":
    main()
