#!/usr/bin/env bash
# Download, on this machine, the wheels verl 0.9.1 needs on the GPU machine (beside the vLLM
# vLLM payload) and split them into parts of at most 50 MB, for machines that take files in small transfers.
# Run from anywhere inside the checkout. Result in the checkout root (kept out of git):
# .verl1, .verl2, ... (one part each) and .verl_run/ (the scripts and checksums).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(git rev-parse --show-toplevel)
W=${VERL_WORK:-/tmp/verl-payload}
grep -qxF '/.verl*/' "$top/.git/info/exclude" 2>/dev/null || echo '/.verl*/' >> "$top/.git/info/exclude"
mkdir -p "$W/wheels"
P=""; for t in 2_28 2_17 2_24 2_31 2_34; do P="$P --platform manylinux_${t}_x86_64"; done
P="$P --platform manylinux2014_x86_64"
grep -v '^#' "$here/wheels.txt" | grep -v antlr > "$W/req.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
  -d "$W/wheels" -r "$W/req.txt"
# hydra's grammar runtime is published as a source distribution only: build its (pure Python) wheel here
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$W/wheels"
rm -rf "$W/parts" "$top"/.verl[0-9]* "$top/.verl_run"
mkdir -p "$W/parts" "$top/.verl_run"
tar -cf "$W/wheels.tar" -C "$W" wheels
split -b 50M -a 2 "$W/wheels.tar" "$W/parts/wheels.tar.part"
(cd "$W/parts" && sha256sum wheels.tar.part* > "$top/.verl_run/parts.sha256")
k=0
for f in "$W"/parts/wheels.tar.part*; do k=$((k+1)); mkdir -p "$top/.verl$k"; cp "$f" "$top/.verl$k/"; done
cp "$here/stash.sh" "$top/.verl_run/"
echo "$k parts ready; on the GPU machine, one after the other:"
for i in $(seq 1 "$k"); do echo "  bash .verl_run/stash.sh $i     (with .verl$i and .verl_run in the checkout there)"; done
echo "the last one installs them into /root/verlsite"
