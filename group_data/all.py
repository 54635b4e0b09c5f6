"""Defaults every host gets: the field report's working deployment.

Any of these can be overridden per hardware class (group_data/<class>.py) or per
host (inventory data). Every key is validated by freetoken_infra.settings.Settings;
an unknown key or a bad value stops the run before any host is touched.
The launch flags are not listed here: they are derived from the GPU (README,
"Launch plan"); set launch_* keys only to override them.
"""

# The engine (freetoken.md): 0.2.1, with the faster kernels; pip's own index
# unless a mirror is set (pip_index_url / pip_extra_index_urls).
engine_package = "freetoken"
engine_version = "0.2.1"
engine_extras = ["accel"]

# Pitfall 2: NVIDIA's modelopt build (NVFP4 experts + FP8 attention); the unsloth
# compressed-tensors build fails with `no quant method for moe.fp8_tensor`.
model_repo = "nvidia/Qwen3.6-35B-A3B-NVFP4"
model_revision = "main"
model_dir = "/var/lib/freetoken/models/Qwen3.6-35B-A3B-NVFP4-nvidia"
model_size_gb = 22.0
model_expert_ram_gb = 16.9
hub_disable_xet = True
# A fleet reads the model from upstream once: set model_cache_host (inventory or group
# data) to the host that serves its verified copy to the others on this port.
model_cache_port = 8090
# The cache listens on the address the fleet reaches its host by (ssh_hostname) unless
# model_cache_bind names another.

# The API: loopback only, port 8000, a key generated on the host.
listen_host = "127.0.0.1"
listen_port = 8000
api_key_source = "generate"

# %UserProfile%\.wslconfig [wsl2] as in the report; vmIdleTimeout=0 (pitfall 4A).
wslconfig_memory = "24GB"
wslconfig_processors = 8
wslconfig_swap = "4GB"
wslconfig_localhost_forwarding = True
wslconfig_vm_idle_timeout = 0
wsl_min_version = "2.7.13"

# Pitfall 3: CUDA 13 from NVIDIA's apt repository, these three packages only.
cuda_packages = ["cuda-nvcc-13-0", "cuda-cudart-dev-13-0", "cuda-cccl-13-0"]
cuda_home = "/usr/local/cuda-13.0"

# Operations advice: stop the engine when swap stays above 2 GB.
guard_swap_limit_gb = 2.0
guard_interval_s = 30
