/*
 * A stand-in libnvidia-ml.so.1 for tests: the NVML entry points vacancyd calls through
 * pynvml, with the signatures and struct layouts of NVML's nvml.h, answering from a
 * scenario file instead of a GPU.
 *
 * The scenario file is named by the environment variable FAKE_NVML_SCENARIO and re-read on
 * every call, so a test changes the "GPU" by rewriting the file. One directive per line:
 *
 *   init CODE                                  nvmlInit returns CODE (default 0)
 *   gpu INDEX UUID BUSID TOTAL_MIB USED_MIB FREE_MIB UTIL_PCT
 *   lost INDEX                                 every call on that GPU: NVML_ERROR_GPU_IS_LOST
 *   err CALL CODE                              CALL in count, handle, uuid, pci, memory, util,
 *                                              compute, graphics, procutil, temp, energy,
 *                                              powerget, powerset
 *   temp INDEX CELSIUS                         nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)
 *   energy INDEX MILLIJOULES                   nvmlDeviceGetTotalEnergyConsumption; without
 *                                              this line: NVML_ERROR_NOT_SUPPORTED
 *   power INDEX DEFAULT_MW MIN_MW MAX_MW       the power limit calls (milliwatts); without
 *                                              this line: NVML_ERROR_NOT_SUPPORTED
 *   euid UID                                   the effective uid nvmlDeviceSetPowerManagement-
 *                                              Limit checks (default: the real one); not 0:
 *                                              NVML_ERROR_NO_PERMISSION, as the driver answers
 *
 * A power limit that nvmlDeviceSetPowerManagementLimit sets outlives the scenario's rewrites,
 * as the driver keeps it until it is unloaded: it is written to the file named by
 * FAKE_NVML_SCENARIO with ".limits" appended, one "INDEX MILLIWATTS" line per GPU (delete it
 * to "reload the driver"). Until a GPU has a line there its limit is DEFAULT_MW.
 *   proc INDEX compute|graphics PID USED_MIB
 *   sample INDEX PID TIMESTAMP_US SM_PCT
 *   nofilter                                   return samples older than lastSeenTimeStamp too
 *                                              (a driver whose counters went backwards)
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16

typedef struct nvmlPciInfo_st {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

/* nvmlProcessInfo_v2_t, which nvml.h also names nvmlProcessInfo_t for the _v3 calls. */
typedef struct nvmlProcessInfo_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

#define MAX_GPUS 8
#define MAX_ROWS 256
#define MIB (1024ULL * 1024ULL)

enum {
    C_COUNT, C_HANDLE, C_UUID, C_PCI, C_MEMORY, C_UTIL, C_COMPUTE, C_GRAPHICS, C_PROCUTIL,
    C_TEMP, C_ENERGY, C_POWERGET, C_POWERSET, C_N
};
static const char *CALLS[C_N] = {"count", "handle", "uuid", "pci", "memory",
                                 "util", "compute", "graphics", "procutil",
                                 "temp", "energy", "powerget", "powerset"};

/* NVML_TEMPERATURE_GPU, the one nvmlTemperatureSensors_t value there is. */
#define NVML_TEMPERATURE_GPU 0

struct gpu {
    int present, lost;
    char uuid[128], bus[64];
    unsigned long long total, used, free;
    unsigned int util;
    int has_temp, has_energy, has_power;
    unsigned int temp;
    unsigned long long energy_mj;
    unsigned int power_default, power_min, power_max;
};
struct proc { int gpu, graphics; unsigned int pid; unsigned long long mem; };
struct sample { int gpu; unsigned int pid; unsigned long long ts; unsigned int sm; };

struct scenario {
    int init_code, nofilter, ngpus;
    int has_euid;
    unsigned int euid;
    int err[C_N];
    struct gpu gpus[MAX_GPUS];
    struct proc procs[MAX_ROWS];
    int nprocs;
    struct sample samples[MAX_ROWS];
    int nsamples;
};

/* Handles point into this array; the fake never dereferences them. */
static char handles[MAX_GPUS];

static int load(struct scenario *s) {
    memset(s, 0, sizeof *s);
    const char *path = getenv("FAKE_NVML_SCENARIO");
    if (path == NULL) return 0;
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    char line[512], word[32], a[128], b[64];
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "%31s", word) != 1 || word[0] == '#') continue;
        if (!strcmp(word, "init")) {
            sscanf(line, "%*s %d", &s->init_code);
        } else if (!strcmp(word, "nofilter")) {
            s->nofilter = 1;
        } else if (!strcmp(word, "gpu")) {
            int i; unsigned long long t, u, fr; unsigned int ut;
            if (sscanf(line, "%*s %d %127s %63s %llu %llu %llu %u", &i, a, b, &t, &u, &fr, &ut) == 7
                && i >= 0 && i < MAX_GPUS) {
                struct gpu *g = &s->gpus[i];
                g->present = 1;
                snprintf(g->uuid, sizeof g->uuid, "%s", a);
                snprintf(g->bus, sizeof g->bus, "%s", b);
                g->total = t * MIB; g->used = u * MIB; g->free = fr * MIB; g->util = ut;
                if (i + 1 > s->ngpus) s->ngpus = i + 1;
            }
        } else if (!strcmp(word, "temp")) {
            int i; unsigned int c;
            if (sscanf(line, "%*s %d %u", &i, &c) == 2 && i >= 0 && i < MAX_GPUS) {
                s->gpus[i].has_temp = 1; s->gpus[i].temp = c;
            }
        } else if (!strcmp(word, "energy")) {
            int i; unsigned long long mj;
            if (sscanf(line, "%*s %d %llu", &i, &mj) == 2 && i >= 0 && i < MAX_GPUS) {
                s->gpus[i].has_energy = 1; s->gpus[i].energy_mj = mj;
            }
        } else if (!strcmp(word, "power")) {
            int i; unsigned int d, lo, hi;
            if (sscanf(line, "%*s %d %u %u %u", &i, &d, &lo, &hi) == 4 && i >= 0 && i < MAX_GPUS) {
                struct gpu *g = &s->gpus[i];
                g->has_power = 1; g->power_default = d; g->power_min = lo; g->power_max = hi;
            }
        } else if (!strcmp(word, "euid")) {
            if (sscanf(line, "%*s %u", &s->euid) == 1) s->has_euid = 1;
        } else if (!strcmp(word, "lost")) {
            int i;
            if (sscanf(line, "%*s %d", &i) == 1 && i >= 0 && i < MAX_GPUS) s->gpus[i].lost = 1;
        } else if (!strcmp(word, "err")) {
            int code;
            if (sscanf(line, "%*s %127s %d", a, &code) == 2)
                for (int c = 0; c < C_N; c++) if (!strcmp(a, CALLS[c])) s->err[c] = code;
        } else if (!strcmp(word, "proc") && s->nprocs < MAX_ROWS) {
            struct proc *p = &s->procs[s->nprocs];
            if (sscanf(line, "%*s %d %127s %u %llu", &p->gpu, a, &p->pid, &p->mem) == 4) {
                p->graphics = !strcmp(a, "graphics");
                p->mem *= MIB;
                s->nprocs++;
            }
        } else if (!strcmp(word, "sample") && s->nsamples < MAX_ROWS) {
            struct sample *p = &s->samples[s->nsamples];
            if (sscanf(line, "%*s %d %u %llu %u", &p->gpu, &p->pid, &p->ts, &p->sm) == 4)
                s->nsamples++;
        }
    }
    fclose(f);
    return 0;
}

/* Resolve a handle to its GPU index and check the call's injected errors. */
static nvmlReturn_t device(struct scenario *s, nvmlDevice_t d, int call, int *index) {
    long i = (char *)d - handles;
    if (d == NULL || i < 0 || i >= MAX_GPUS || !s->gpus[i].present)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (s->gpus[i].lost) return NVML_ERROR_GPU_IS_LOST;
    if (s->err[call]) return s->err[call];
    *index = (int)i;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    struct scenario s; load(&s);
    return s.init_code;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case 9: return "Driver Not Loaded";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case 10: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    struct scenario s; load(&s);
    if (s.err[C_COUNT]) return s.err[C_COUNT];
    *count = (unsigned int)s.ngpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *out) {
    struct scenario s; load(&s);
    if (s.err[C_HANDLE]) return s.err[C_HANDLE];
    if (index >= MAX_GPUS || !s.gpus[index].present) return NVML_ERROR_INVALID_ARGUMENT;
    if (s.gpus[index].lost) return NVML_ERROR_GPU_IS_LOST;
    *out = (nvmlDevice_t)&handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, C_UUID, &i);
    if (r) return r;
    if (strlen(s.gpus[i].uuid) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(uuid, s.gpus[i].uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, C_PCI, &i);
    if (r) return r;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", s.gpus[i].bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", s.gpus[i].bus);
    sscanf(s.gpus[i].bus, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, C_MEMORY, &i);
    if (r) return r;
    memory->total = s.gpus[i].total;
    memory->used = s.gpus[i].used;
    memory->free = s.gpus[i].free;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *util) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, C_UTIL, &i);
    if (r) return r;
    util->gpu = s.gpus[i].util;
    util->memory = 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t processes(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos,
                              int graphics) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, graphics ? C_GRAPHICS : C_COMPUTE, &i);
    if (r) return r;
    unsigned int n = 0;
    for (int k = 0; k < s.nprocs; k++)
        if (s.procs[k].gpu == i && s.procs[k].graphics == graphics) n++;
    if (infos == NULL || *count < n) {
        unsigned int have = *count;
        *count = n;
        return (n == 0 && have == 0) ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    n = 0;
    for (int k = 0; k < s.nprocs; k++) {
        if (s.procs[k].gpu != i || s.procs[k].graphics != graphics) continue;
        infos[n].pid = s.procs[k].pid;
        infos[n].usedGpuMemory = s.procs[k].mem;
        infos[n].gpuInstanceId = 0xFFFFFFFF;
        infos[n].computeInstanceId = 0xFFFFFFFF;
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return processes(d, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    return processes(d, count, infos, 1);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, C_PROCUTIL, &i);
    if (r) return r;
    unsigned int n = 0;
    for (int k = 0; k < s.nsamples; k++)
        if (s.samples[k].gpu == i && (s.nofilter || s.samples[k].ts > lastSeenTimeStamp)) n++;
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (utilization == NULL || *processSamplesCount < n) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    n = 0;
    for (int k = 0; k < s.nsamples; k++) {
        if (s.samples[k].gpu != i || !(s.nofilter || s.samples[k].ts > lastSeenTimeStamp))
            continue;
        utilization[n].pid = s.samples[k].pid;
        utilization[n].timeStamp = s.samples[k].ts;
        utilization[n].smUtil = s.samples[k].sm;
        utilization[n].memUtil = 0;
        utilization[n].encUtil = 0;
        utilization[n].decUtil = 0;
        n++;
    }
    *processSamplesCount = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensorType, unsigned int *temp) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, C_TEMP, &i);
    if (r) return r;
    if (sensorType != NVML_TEMPERATURE_GPU || temp == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!s.gpus[i].has_temp) return NVML_ERROR_NOT_SUPPORTED;
    *temp = s.gpus[i].temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *energy) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = device(&s, d, C_ENERGY, &i);
    if (r) return r;
    if (energy == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!s.gpus[i].has_energy) return NVML_ERROR_NOT_SUPPORTED;
    *energy = s.gpus[i].energy_mj;
    return NVML_SUCCESS;
}

/* The limits file: FAKE_NVML_SCENARIO + ".limits". */
static int limits_path(char *out, size_t size) {
    const char *path = getenv("FAKE_NVML_SCENARIO");
    if (path == NULL) return 0;
    snprintf(out, size, "%s.limits", path);
    return 1;
}

static unsigned int current_limit(struct scenario *s, int index) {
    unsigned int limit = s->gpus[index].power_default;
    char path[1024];
    if (!limits_path(path, sizeof path)) return limit;
    FILE *f = fopen(path, "r");
    if (f == NULL) return limit;
    int i; unsigned int mw;
    while (fscanf(f, "%d %u", &i, &mw) == 2)
        if (i == index) limit = mw;
    fclose(f);
    return limit;
}

static nvmlReturn_t power_device(struct scenario *s, nvmlDevice_t d, int call, int *index) {
    nvmlReturn_t r = device(s, d, call, index);
    if (r) return r;
    if (!s->gpus[*index].has_power) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned int *limit) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = power_device(&s, d, C_POWERGET, &i);
    if (r) return r;
    if (limit == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = current_limit(&s, i);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t d, unsigned int *minLimit,
                                                         unsigned int *maxLimit) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = power_device(&s, d, C_POWERGET, &i);
    if (r) return r;
    if (minLimit == NULL || maxLimit == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *minLimit = s.gpus[i].power_min;
    *maxLimit = s.gpus[i].power_max;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t d, unsigned int *defaultLimit) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = power_device(&s, d, C_POWERGET, &i);
    if (r) return r;
    if (defaultLimit == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *defaultLimit = s.gpus[i].power_default;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t d, unsigned int limit) {
    struct scenario s; load(&s);
    int i; nvmlReturn_t r = power_device(&s, d, C_POWERSET, &i);
    if (r) return r;
    unsigned int euid = s.has_euid ? s.euid : (unsigned int)geteuid();
    if (euid != 0) return NVML_ERROR_NO_PERMISSION;
    if (limit < s.gpus[i].power_min || limit > s.gpus[i].power_max)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* Keep every other GPU's line, replace this one's. */
    char path[1024], tmp[1100];
    if (!limits_path(path, sizeof path)) return NVML_ERROR_UNKNOWN;
    unsigned int limits[MAX_GPUS]; int set[MAX_GPUS] = {0};
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        int k; unsigned int mw;
        while (fscanf(f, "%d %u", &k, &mw) == 2)
            if (k >= 0 && k < MAX_GPUS) { limits[k] = mw; set[k] = 1; }
        fclose(f);
    }
    limits[i] = limit; set[i] = 1;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    f = fopen(tmp, "w");
    if (f == NULL) return NVML_ERROR_UNKNOWN;
    for (int k = 0; k < MAX_GPUS; k++)
        if (set[k]) fprintf(f, "%d %u\n", k, limits[k]);
    fclose(f);
    return rename(tmp, path) == 0 ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}
