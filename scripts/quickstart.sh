#!/usr/bin/env bash
# The quickstart from a fresh checkout: virtual environment, install, Fashion-MNIST, training, evaluation, plots.
#
#   scripts/quickstart.sh [RUN_DIR]          (default runs/quickstart; run again to resume an interrupted run)
#
# Environment: VENV (default .venv), DATA_DIR (default data/fashion-mnist), PYTHON (default python3).
# Data: the Debian package dataset-fashion-mnist when apt can install it, else torchvision's downloader.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/quickstart}
VENV=${VENV:-.venv}
DATA_DIR=${DATA_DIR:-data/fashion-mnist}
DEBIAN_DIR=/usr/share/datasets/fashion-mnist

step() { printf '\n== %s\n' "$*"; }

step "Python environment ($VENV)"
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip install --quiet -e '.[plots]'   # pip picks torch and torchvision together

step "Fashion-MNIST"
download=false
if [ ! -f "$DEBIAN_DIR/train-images-idx3-ubyte.gz" ] && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) || true
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    (sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist) || true
  fi
fi
if [ -f "$DEBIAN_DIR/train-images-idx3-ubyte.gz" ]; then
  echo "using the Debian package's files in $DEBIAN_DIR"
else
  echo "no Debian package: torchvision will download Fashion-MNIST into $DATA_DIR"
  download=true
fi

step "Training (configs/quickstart.yaml -> $RUN_DIR)"
python train.py --config configs/quickstart.yaml --output "$RUN_DIR" --resume auto \
  data.data_dir="$DATA_DIR" data.download=$download

step "Evaluation of the exported best weights with validate.py"
# The test split through timm's create_dataset, as training read it: its labels and class names are the model's.
python validate.py --checkpoint "$RUN_DIR" --dataset torch/fashion_mnist --split test --data-dir "$DATA_DIR" --cpu \
  --workers 2 --results-file "$RUN_DIR/test_results.json"

step "Done"
echo "metrics: $RUN_DIR/metrics.jsonl   plots: $RUN_DIR/plots/   weights: $RUN_DIR/export/best/"
