/* STAND-IN for NVIDIA's libnvidia-ml.so.1 (NVML, the NVIDIA Management Library) as WSL2 maps it
 * from the Windows driver into /usr/lib/wsl/lib. Implements only the calls the host agent makes
 * (operations/scripts/owner_agent.py, class Nvml), with the signatures, types, return codes and
 * error strings of NVIDIA's nvml.h:
 *   nvmlInit_v2 (and nvmlInit), nvmlShutdown, nvmlDeviceGetCount_v2,
 *   nvmlDeviceGetHandleByIndex_v2 (and nvmlDeviceGetHandleByIndex), nvmlDeviceGetMemoryInfo
 *   (nvmlMemory_t: unsigned long long total, free, used, in bytes), nvmlDeviceGetPowerUsage
 *   (unsigned int, milliwatts), nvmlDeviceGetName, nvmlErrorString.
 * The device is the simulated host's GPU as the other stand-ins read it: memory_total_mib and
 * memory_used_mib from $FREETOKEN_SIM_DIR/gpu.conf (default /.sim/gpu.conf, written by
 * tests/fleet/harness.py from the host profile, as libcuda.c reads it), and the used memory
 * from $FREETOKEN_SIM_DIR/gpu-memory-used-mib when that file holds a number (the owner's game,
 * as bin/nvidia-smi reads it), read again at every nvmlDeviceGetMemoryInfo. The power draw is
 * bin/nvidia-smi's power.draw: 142.31 W while more than 2 GiB is used, else 6.12 W. No GPU is
 * involved. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlMemory_st {
    unsigned long long total; /* bytes */
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_UNKNOWN 999
#define MIB (1024ULL * 1024ULL)

struct nvmlDevice_st { int index; };

static int init_count;
static struct nvmlDevice_st the_device;
static char gpu_name[96] = "NVIDIA GeForce RTX 5060 Ti";

static const char *sim_dir(void) {
    const char *dir = getenv("FREETOKEN_SIM_DIR");
    return dir && *dir ? dir : "/.sim";
}

/* memory_total_mib and memory_used_mib of gpu.conf; 0 when it cannot be read. */
static int load_config(unsigned long long *total_mib, unsigned long long *used_mib) {
    char path[4096], line[512];
    snprintf(path, sizeof path, "%s/gpu.conf", sim_dir());
    FILE *f = fopen(path, "r");
    *total_mib = *used_mib = 0;
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        char *eq = strchr(line, '='), *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        if (!eq || line[0] == '#') continue;
        *eq = 0;
        if (!strcmp(line, "memory_total_mib")) *total_mib = strtoull(eq + 1, NULL, 10);
        else if (!strcmp(line, "memory_used_mib")) *used_mib = strtoull(eq + 1, NULL, 10);
        else if (!strcmp(line, "name")) snprintf(gpu_name, sizeof gpu_name, "%s", eq + 1);
    }
    fclose(f);
    return *total_mib > 0;
}

/* The game's figure, as bin/nvidia-smi takes it: the file's number (surrounding blanks allowed). */
static void load_used_override(unsigned long long *used_mib) {
    char path[4096], text[64], *end;
    snprintf(path, sizeof path, "%s/gpu-memory-used-mib", sim_dir());
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    char *p = text;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (*p < '0' || *p > '9') return;
    unsigned long long value = strtoull(p, &end, 10);
    while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r') end++;
    if (*end == 0) *used_mib = value;
}

nvmlReturn_t nvmlInit_v2(void) {
    unsigned long long total, used;
    if (!load_config(&total, &used)) return NVML_ERROR_DRIVER_NOT_LOADED;
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

nvmlReturn_t nvmlShutdown(void) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!device || index != 0) return NVML_ERROR_INVALID_ARGUMENT;
    the_device.index = 0;
    *device = &the_device;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    unsigned long long total, used;
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (device != &the_device || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (!load_config(&total, &used)) return NVML_ERROR_UNKNOWN;
    load_used_override(&used);
    memory->total = total * MIB;
    memory->used = used * MIB; /* as nvidia-smi's memory.used, even above the total */
    memory->free = used < total ? (total - used) * MIB : 0;
    return NVML_SUCCESS;
}

/* nvml.h: "power usage for this GPU in milliwatts and its associated circuitry (e.g. memory)". */
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    unsigned long long total, used;
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (device != &the_device || !power) return NVML_ERROR_INVALID_ARGUMENT;
    if (!load_config(&total, &used)) return NVML_ERROR_UNKNOWN;
    load_used_override(&used);
    *power = used > 2048 ? 142310 : 6120; /* as bin/nvidia-smi's power.draw */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (device != &the_device || !name) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(gpu_name) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(name, length, "%s", gpu_name);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}
