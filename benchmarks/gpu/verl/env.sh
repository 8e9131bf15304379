#!/usr/bin/env bash
# On the GPU machine, once the vLLM payload (unpacked into /root/vsite by the vLLM recipe's
# final.sh) and the verl wheels (/root/verlsite, stash.sh) are there: run COMMAND with both importable.
#   usage: bash benchmarks/gpu/verl/env.sh python3 benchmarks/gpu_vs_verl.py ...
[ -f /root/vsite/.complete ] && [ -f /root/verlsite/.complete ] || { echo "vLLM payload or verl wheels missing"; exit 3; }
# cutlass registers its packages through a .pth file, which PYTHONPATH does not process
export PYTHONPATH=/root/verlsite:/root/vsite:/root/vsite/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export PATH=/root/verlsite/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$@"
