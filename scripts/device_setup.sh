#!/usr/bin/env bash
# Used on the GPU machine (no package registry there): installs the fla wheels carried in .whl/
# (see README, "Running on a GPU machine without a registry") into /tmp/site and this repo on PYTHONPATH.
# Source it: `. scripts/device_setup.sh`.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton, fla, fla_falcon; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())"
