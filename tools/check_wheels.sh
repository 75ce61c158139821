#!/usr/bin/env bash
# Builds every package's wheel and installs each one alone in a fresh virtual environment (with only
# the wheels of the llamarl packages it declares), then imports it. Usage: tools/check_wheels.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out/wheels"
for pkg in comm algo exec control sim; do
  (cd "packages/llamarl-$pkg" && uv build --quiet --wheel --out-dir "$out/wheels")
done
for pkg in comm algo exec control sim; do
  venv="$out/venv-$pkg"
  uv venv --quiet -p 3.11 "$venv"
  # --find-links serves the sibling llamarl wheels a package depends on; everything else comes from
  # the package index, so a dependency missing from a pyproject fails the import below.
  uv pip install --quiet -p "$venv" --find-links "$out/wheels" "$out"/wheels/llamarl_${pkg}-*.whl
  # Every module, not just the package: the packages' __init__ files load their names lazily.
  "$venv/bin/python" -W ignore -c "
import importlib, pkgutil, llamarl.$pkg as m
names = [i.name for i in pkgutil.walk_packages(m.__path__, 'llamarl.$pkg.')]
for name in names: importlib.import_module(name)
print('llamarl.$pkg: %d modules import from' % (len(names) + 1), m.__path__[0])"
  echo "  llamarl-$pkg installs: $(uv pip list -p "$venv" 2>/dev/null | awk 'NR>2 {print $1}' | grep -v -e '^nvidia' -e '^cuda' | tr '\n' ' ')"
done
