"""GPU benchmarks: ``python -m treecompile.bench <name>``."""
