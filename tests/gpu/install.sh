#!/usr/bin/env bash
# Device machine (no network): gguf from the carried wheel into /tmp/site (once a machine), treecompile
# editable from the working tree. Exits 3 with the install log's tail when treecompile does not install.
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 3; }
