"""What an anonymous Inductor kernel of a profile fuses: finds the compiled-graph modules in an Inductor cache that
mention MARKER (e.g. ``draft_topk``: the draft round's graph; ``-``: every module) and prints, for each named kernel, the "Source
Nodes" / "Original ATen" comments Inductor writes above it. Profiles name combo and long kernels only
``triton_red_fused_17``; this says which ops they are. Where those comments are empty (the forty-sixth session's
draft round: "Unsorted Source Nodes: []"), ``--source`` also prints the kernel's source and the lines of the
module's ``call`` around each launch of it (the buffers it reads and writes, and the comments there), and the
autotuner's pick for it (``.best_config``).

    python3 tests/gpu/inductor_kernels.py [--source] CACHE_DIR MARKER NAME [NAME ...]
"""

from __future__ import annotations

import os
import re
import sys


def modules(cache_dir: str, marker: str):
    """Paths of the generated ``.py`` files under ``cache_dir`` whose text holds ``marker``."""
    for root, _, files in os.walk(cache_dir):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                try:
                    with open(path, errors="replace") as f:
                        text = f.read()
                except OSError:
                    continue
                if marker == "-" or marker in text:
                    yield path, text


def kernel_comments(text: str, name: str) -> list[str]:
    """The comment lines Inductor put above ``name``'s definition (its source nodes), and the kernel's size."""
    found = []
    for m in re.finditer(rf"^{re.escape(name)} = async_compile\.triton\(", text, re.M):
        head = text.rfind("\n\n", 0, m.start())
        block = text[head:m.start()].strip().splitlines()
        found.extend(line for line in block if line.startswith("#"))
        start = text.find("'''", m.end()) + 3
        end = text.find("'''", start)
        found.append(f"# ({(end - start) if start >= 3 and end > 0 else '?'} characters of kernel source)")
    return found


def kernel_source(text: str, name: str, max_lines: int = 160) -> list[str]:
    """The kernel's Triton source (the string handed to ``async_compile.triton``), at most ``max_lines`` lines."""
    found = []
    for m in re.finditer(rf"^{re.escape(name)} = async_compile\.triton\(", text, re.M):
        start = text.find("'''", m.end()) + 3
        end = text.find("'''", start)
        if start >= 3 and end > 0:
            lines = text[start:end].strip("\n").splitlines()
            found.extend(lines[:max_lines] + ([f"# ... {len(lines) - max_lines} more lines"] if len(lines) > max_lines else []))
    return found


def best_configs(comments: list[str]) -> list[str]:
    """The autotuner's pick for the kernel: the ``.best_config`` files in the directory of each ``# kernel path:`` in
    its comments (XBLOCK, R0_BLOCK, num_warps: which of Inductor's reduction configs ran). Recent torch names them
    by a hash of the kernel file's name, so every one in that directory is printed (the directory holds the kernels
    whose hash starts alike: usually one). Kernels with a single config have none."""
    found = []
    for line in comments:
        if line.startswith("# kernel path:"):
            path = line.split(":", 1)[1].strip()
            folder = os.path.dirname(path)
            stem = os.path.splitext(os.path.basename(path))[0]
            try:
                names = sorted(n for n in os.listdir(folder) if n.endswith(".best_config"))
            except OSError:
                names = []
            if not names:
                found.append(f"# best_config: none in {folder}")
            for name in names:
                same = " (this kernel's name)" if name.startswith(stem) else ""
                with open(os.path.join(folder, name), errors="replace") as f:
                    found.append(f"# best_config {name}{same}: {f.read().strip()[:400]}")
    return found


def launch_sites(text: str, name: str, before: int = 6, after: int = 1) -> list[str]:
    """The lines around each ``name.run(`` in the module (its arguments, the buffers' allocations and comments)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if f"{name}.run(" in line:
            found.append(f"# launch at line {i + 1}:")
            found.extend(lines[max(0, i - before) : i + 1 + after])
    return found


def main(argv: list[str]) -> int:
    source = "--source" in argv
    argv = [a for a in argv if a != "--source"]
    if len(argv) < 3:
        print(__doc__)
        return 2
    cache_dir, marker, names = argv[0], argv[1], argv[2:]
    any_found = False
    for path, text in modules(cache_dir, marker):
        for name in names:
            lines = kernel_comments(text, name)
            if lines:
                any_found = True
                print(f"== {name} in {path}")
                print("\n".join(lines))
                if source:
                    print("\n".join(best_configs(lines)))
                    print("\n".join(launch_sites(text, name)))
                    print("\n".join(kernel_source(text, name)))
    return 0 if any_found else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
