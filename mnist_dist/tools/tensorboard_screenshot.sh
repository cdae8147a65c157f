#!/usr/bin/env bash
# docs/tensorboard.png as a person sees it: the three-mode sweep the docs show, run by exactly their
# command, then TensorBoard's CUSTOM SCALARS tab in headless Chromium (Debian: apt-get install chromium).
# Run from the repository root, venv active:
#   bash mnist_dist/tools/tensorboard_screenshot.sh [docs/tensorboard.png]
set -euo pipefail
out=${1:-docs/tensorboard.png}
log=$(mktemp /tmp/mnist_dist_sweep.XXXXXX.log)
python -m mnist_dist -m mode=single,ddp,torch_ddp gpus=2 recipe=fast data=fashion_mnist 'data.mirrors=[/usr/share/datasets/fashion-mnist]' epochs=1 \
    2>&1 | tee "$log"
sweep=$(dirname "$(sed -n 's/.*run directory: //p' "$log" | head -1)") # each run says where it is
tensorboard --logdir "$sweep" --host 127.0.0.1 --port 6123 >"$sweep/tensorboard.log" 2>&1 &
board=$!
trap 'kill $board' EXIT
sleep 15 # until it has read the event files
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
    --virtual-time-budget=20000 --screenshot="$PWD/$out" "http://localhost:6123/#custom_scalars"
echo "wrote $out from $sweep"
