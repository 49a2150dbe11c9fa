# The environment of megarl's GPU scripts (sourced from the repo root) on a machine without network: the packages
# that perf/install_wheels.sh puts in $SITE (/tmp/site) ahead of the repo on the path, vLLM in-process and
# offline, and NVLink multicast off (the device machines' rule: a program using it can put a shared host's GPUs
# out of service).
export SITE=/tmp/site
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
