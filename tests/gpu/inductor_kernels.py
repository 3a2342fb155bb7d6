"""What an anonymous Inductor kernel of a profile fuses: finds the compiled-graph modules in an Inductor cache that
mention MARKER (e.g. ``draft_topk``: the draft round's graph; ``-``: every module) and prints, for each named kernel, the "Source
Nodes" / "Original ATen" comments Inductor writes above it. Profiles name combo and long kernels only
``triton_red_fused_17``; this says which ops they are.

    python3 tests/gpu/inductor_kernels.py CACHE_DIR MARKER NAME [NAME ...]
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


def main(argv: list[str]) -> int:
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
    return 0 if any_found else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
