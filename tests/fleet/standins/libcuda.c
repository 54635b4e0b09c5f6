/* STAND-IN for NVIDIA's libcuda.so.1 (the CUDA driver API) as WSL2 maps it from the Windows
 * driver into /usr/lib/wsl/lib. Implements only the driver-API calls a GPU memory probe makes,
 * with the real signatures, return codes and error names/strings:
 *   cuInit, cuDriverGetVersion, cuDeviceGetCount, cuDeviceGet, cuDeviceGetName,
 *   cuDeviceTotalMem_v2, cuDeviceGetAttribute (compute capability), cuDeviceComputeCapability,
 *   cuCtxCreate_v2, cuCtxDestroy_v2, cuCtxGetCurrent, cuCtxSetCurrent, cuMemGetInfo_v2,
 *   cuMemAlloc_v2, cuMemFree_v2, cuGetErrorName, cuGetErrorString (+ unversioned aliases).
 * The device is described by a key=value file ($FREETOKEN_SIM_GPU_CONF, default
 * /.sim/gpu.conf) that tests/fleet/harness.py writes from the host profile. With
 * allocation_locked=1 it imitates the WDDM allocation lock of old WSL (field report pitfall 4B):
 * cuMemGetInfo reports locked_free_mib free, yet every cuMemAlloc fails with
 * CUDA_ERROR_OUT_OF_MEMORY. No memory is really allocated; pointers are fake. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define MIB (1024ULL * 1024ULL)

struct CUctx_st { int device; };

static int initialized, have_device, locked, cc_major = 12, cc_minor = 0, driver_api = 13000;
static unsigned long long total_mib, used_mib, locked_free_mib, allocated;
static char gpu_name[256] = "NVIDIA GeForce RTX 5060 Ti";
static struct CUctx_st the_context;
static CUcontext current;
static CUdeviceptr next_ptr = 0x7f4a00000000ULL;

static void load_config(void) {
    const char *path = getenv("FREETOKEN_SIM_GPU_CONF");
    char line[512];
    FILE *f = fopen(path ? path : "/.sim/gpu.conf", "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char *eq = strchr(line, '='), *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        if (!eq || line[0] == '#') continue;
        *eq = 0;
        const char *k = line, *v = eq + 1;
        if (!strcmp(k, "name")) snprintf(gpu_name, sizeof gpu_name, "%s", v);
        else if (!strcmp(k, "memory_total_mib")) total_mib = strtoull(v, NULL, 10);
        else if (!strcmp(k, "memory_used_mib")) used_mib = strtoull(v, NULL, 10);
        else if (!strcmp(k, "locked_free_mib")) locked_free_mib = strtoull(v, NULL, 10);
        else if (!strcmp(k, "allocation_locked")) locked = atoi(v);
        else if (!strcmp(k, "compute_cap")) sscanf(v, "%d.%d", &cc_major, &cc_minor);
        else if (!strcmp(k, "cuda_driver_api_version")) driver_api = atoi(v);
    }
    fclose(f);
    have_device = total_mib > 0;
}

CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    load_config();
    if (!have_device) return CUDA_ERROR_NO_DEVICE;
    initialized = 1;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = driver_api;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", gpu_name);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)(total_mib * MIB);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (attrib == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) *value = cc_major;
    else if (attrib == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) *value = cc_minor;
    else return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    *major = cc_major;
    *minor = cc_minor;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    the_context.device = dev;
    current = &the_context;
    *pctx = current;
    return CUDA_SUCCESS;
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx != &the_context) return CUDA_ERROR_INVALID_CONTEXT;
    if (current == ctx) current = NULL;
    allocated = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = current;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx && ctx != &the_context) return CUDA_ERROR_INVALID_CONTEXT;
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long free_now = locked ? locked_free_mib * MIB
                                         : (total_mib - used_mib) * MIB - allocated;
    *free_bytes = (size_t)free_now;
    *total_bytes = (size_t)(total_mib * MIB);
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    if (locked) return CUDA_ERROR_OUT_OF_MEMORY;  /* the WDDM lock: nothing is allocatable */
    unsigned long long rounded = (bytesize + 2 * MIB - 1) / (2 * MIB) * (2 * MIB);
    if (allocated + rounded > (total_mib - used_mib) * MIB) return CUDA_ERROR_OUT_OF_MEMORY;
    allocated += rounded;
    *dptr = next_ptr;
    next_ptr += rounded;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    if (dptr == 0) return CUDA_SUCCESS;
    /* sizes are not tracked per pointer: freeing releases the smallest unit */
    allocated = allocated >= 2 * MIB ? allocated - 2 * MIB : 0;
    return CUDA_SUCCESS;
}

static const char *names[][3] = {
    {"0", "CUDA_SUCCESS", "no error"},
    {"1", "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {"2", "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {"3", "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {"100", "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {"101", "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {"201", "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {"999", "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult lookup(CUresult error, const char **pstr, int column) {
    if (!pstr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (atoi(names[i][0]) == error) { *pstr = names[i][column]; return CUDA_SUCCESS; }
    *pstr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char **pstr) { return lookup(error, pstr, 1); }
CUresult cuGetErrorString(CUresult error, const char **pstr) { return lookup(error, pstr, 2); }

/* Unversioned names, as old binaries (and some ctypes probes) call them. */
CUresult cuDeviceTotalMem(size_t *b, CUdevice d) { return cuDeviceTotalMem_v2(b, d); }
CUresult cuCtxCreate(CUcontext *c, unsigned int f, CUdevice d) { return cuCtxCreate_v2(c, f, d); }
CUresult cuCtxDestroy(CUcontext c) { return cuCtxDestroy_v2(c); }
CUresult cuMemGetInfo(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }
CUresult cuMemAlloc(CUdeviceptr *p, size_t s) { return cuMemAlloc_v2(p, s); }
CUresult cuMemFree(CUdeviceptr p) { return cuMemFree_v2(p); }
