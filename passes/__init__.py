"""FX graph passes run by the treespec backend, one pass per file, each ``(gm, ctx) -> gm``."""

PASSES: list = []  # the explicit ordered pass list; filled as passes land
