/*
 * Scenario files: parsing and the time model. See README.md for the format.
 */
#define _POSIX_C_SOURCE 200809L

#include "scenario.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum key_kind {
    KIND_U32,  /* integer that NVML returns as unsigned int */
    KIND_U64,  /* integer that NVML returns as unsigned long long */
    KIND_PCT,  /* percentage, fractions allowed (GPM metrics are doubles) */
};

struct key_info {
    const char *name;
    enum key_kind kind;
    double default_value;
    bool is_static; /* device lines only */
};

/* Defaults describe an idle NVIDIA H100 80GB HBM3 (SXM5). */
static const struct key_info KEYS[K_COUNT] = {
    [K_COMPUTE_CAPABILITY_MAJOR] = {"compute_capability_major", KIND_U32, 9, false},
    [K_COMPUTE_CAPABILITY_MINOR] = {"compute_capability_minor", KIND_U32, 0, false},
    [K_ARCHITECTURE] = {"architecture", KIND_U32, 9, false},
    [K_MEMORY_TOTAL_BYTES] = {"memory_total_bytes", KIND_U64, 85899345920.0, false},
    [K_MEMORY_RESERVED_BYTES] = {"memory_reserved_bytes", KIND_U64, 553648128.0, false},
    [K_MEMORY_USED_BYTES] = {"memory_used_bytes", KIND_U64, 0, false},
    [K_MAX_SM_CLOCK_MHZ] = {"max_sm_clock_mhz", KIND_U32, 1980, false},
    [K_MAX_MEM_CLOCK_MHZ] = {"max_mem_clock_mhz", KIND_U32, 2619, false},
    [K_MAX_GRAPHICS_CLOCK_MHZ] = {"max_graphics_clock_mhz", KIND_U32, 1980, false},
    [K_MAX_VIDEO_CLOCK_MHZ] = {"max_video_clock_mhz", KIND_U32, 1545, false},
    [K_SM_CLOCK_MHZ] = {"sm_clock_mhz", KIND_U32, 345, false},
    [K_MEM_CLOCK_MHZ] = {"mem_clock_mhz", KIND_U32, 2619, false},
    [K_GRAPHICS_CLOCK_MHZ] = {"graphics_clock_mhz", KIND_U32, 345, false},
    [K_VIDEO_CLOCK_MHZ] = {"video_clock_mhz", KIND_U32, 765, false},
    [K_POWER_MW] = {"power_mw", KIND_U32, 70000, false},
    [K_POWER_AVERAGE_MW] = {"power_average_mw", KIND_U32, 70000, false},
    [K_POWER_LIMIT_MW] = {"power_limit_mw", KIND_U32, 700000, false},
    [K_GPU_TEMP_C] = {"gpu_temp_c", KIND_U32, 32, false},
    [K_MEM_TEMP_C] = {"mem_temp_c", KIND_U32, 30, false},
    [K_SLOWDOWN_TEMP_C] = {"slowdown_temp_c", KIND_U32, 87, false},
    [K_SHUTDOWN_TEMP_C] = {"shutdown_temp_c", KIND_U32, 92, false},
    [K_GPU_UTIL_PCT] = {"gpu_util_pct", KIND_U32, 0, false},
    [K_MEM_UTIL_PCT] = {"mem_util_pct", KIND_U32, 0, false},
    [K_PCIE_GEN] = {"pcie_gen", KIND_U32, 5, false},
    [K_PCIE_WIDTH] = {"pcie_width", KIND_U32, 16, false},
    [K_MAX_PCIE_GEN] = {"max_pcie_gen", KIND_U32, 5, false},
    [K_MAX_PCIE_WIDTH] = {"max_pcie_width", KIND_U32, 16, false},
    [K_PCIE_TX_KBPS] = {"pcie_tx_kbps", KIND_U32, 0, false},
    [K_PCIE_RX_KBPS] = {"pcie_rx_kbps", KIND_U32, 0, false},
    [K_FAN_PCT] = {"fan_pct", KIND_U32, 0, false},
    [K_PSTATE] = {"pstate", KIND_U32, 0, false},
    [K_REASONS] = {"reasons", KIND_U64, 0x1, false},
    [K_ECC_CORRECTED] = {"ecc_corrected", KIND_U64, 0, false},
    [K_ECC_UNCORRECTED] = {"ecc_uncorrected", KIND_U64, 0, false},
    [K_REMAPPED_CORRECTED] = {"remapped_corrected", KIND_U32, 0, false},
    [K_REMAPPED_UNCORRECTED] = {"remapped_uncorrected", KIND_U32, 0, false},
    [K_REMAPPED_PENDING] = {"remapped_pending", KIND_U32, 0, false},
    [K_REMAPPED_FAILURE] = {"remapped_failure", KIND_U32, 0, false},
    [K_GPM_SUPPORTED] = {"gpm_supported", KIND_U32, 1, false},
    [K_GPM_DRAM_BW_UTIL_PCT] = {"gpm_dram_bw_util_pct", KIND_PCT, 0, false},
    [K_GPM_SM_OCCUPANCY_PCT] = {"gpm_sm_occupancy_pct", KIND_PCT, 0, false},
    [K_GPM_TENSOR_UTIL_PCT] = {"gpm_tensor_util_pct", KIND_PCT, 0, false},
    [K_GPM_SM_UTIL_PCT] = {"gpm_sm_util_pct", KIND_PCT, 0, false},
    [K_GPM_GRAPHICS_UTIL_PCT] = {"gpm_graphics_util_pct", KIND_PCT, 0, false},
    [K_ENERGY_MJ] = {"energy_mj", KIND_U64, 0, true},
    [K_PCI_DEVICE_ID] = {"pci_device_id", KIND_U32, 0x233010DE, true},
    [K_PCI_SUBSYSTEM_ID] = {"pci_subsystem_id", KIND_U32, 0x16C110DE, true},
    [K_SUPPORTED_REASONS] = {"supported_reasons", KIND_U64, 0x1FF, true},
    [K_SUPPORTED_EVENT_TYPES] = {"supported_event_types", KIND_U64, 0x11F, true},
    [K_MIG_MODE] = {"mig_mode", KIND_U32, 0, true},
    [K_MAX_MIG_DEVICES] = {"max_mig_devices", KIND_U32, 7, true},
    [K_NUMA_NODE] = {"numa_node", KIND_U32, 0, true}, /* never set: NOT_SUPPORTED */
};

static const char *const FN_NAMES[FN_COUNT] = {
#define FAKE_FN_NAME(name) #name,
    FAKE_DEVICE_FUNCTIONS(FAKE_FN_NAME)
#undef FAKE_FN_NAME
};

const char *fn_name(enum fn fn) { return FN_NAMES[fn]; }

/* PCI buses of the eight GPUs in an HGX H100 baseboard, for default bus ids. */
static const unsigned int DEFAULT_PCI_BUS[] = {0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB};

#define MAX_TOKENS 128

struct parser {
    const char *path;
    unsigned int line;
    struct scenario *scenario;
};

static void report(const struct parser *p, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void report(const struct parser *p, const char *fmt, ...)
{
    char message[512];
    va_list args;
    va_start(args, fmt);
    vsnprintf(message, sizeof message, fmt, args);
    va_end(args);
    fprintf(stderr, "fakenvml: %s:%u: %s\n", p->path, p->line, message);
}

static bool grow(void **items, size_t *cap, size_t n, size_t size)
{
    if (n < *cap) {
        return true;
    }
    size_t new_cap = *cap ? *cap * 2 : 8;
    void *bigger = realloc(*items, new_cap * size);
    if (bigger == NULL) {
        return false;
    }
    *items = bigger;
    *cap = new_cap;
    return true;
}

/* Splits a line in place into whitespace-separated tokens; "double quoted" tokens may hold
 * spaces and '#'; an unquoted '#' starts a comment. Returns the count, or -1 after reporting. */
static int tokenize(const struct parser *p, char *line, char **tokens)
{
    int count = 0;
    char *cursor = line;
    for (;;) {
        while (*cursor != '\0' && isspace((unsigned char)*cursor)) {
            cursor++;
        }
        if (*cursor == '\0' || *cursor == '#') {
            return count;
        }
        if (count == MAX_TOKENS) {
            report(p, "too many tokens (at most %d)", MAX_TOKENS);
            return -1;
        }
        if (*cursor == '"') {
            char *close = strchr(cursor + 1, '"');
            if (close == NULL) {
                report(p, "unterminated double-quoted string");
                return -1;
            }
            *close = '\0';
            tokens[count++] = cursor + 1;
            cursor = close + 1;
            if (*cursor != '\0' && !isspace((unsigned char)*cursor)) {
                report(p, "a double-quoted string must be followed by whitespace");
                return -1;
            }
            continue;
        }
        tokens[count++] = cursor;
        while (*cursor != '\0' && !isspace((unsigned char)*cursor)) {
            if (*cursor == '"') {
                report(p, "a double quote may only start a token");
                return -1;
            }
            cursor++;
        }
        if (*cursor != '\0') {
            *cursor++ = '\0';
        }
    }
}

static bool parse_double(const char *text, double *out)
{
    char *end;
    errno = 0;
    double value = strtod(text, &end);
    if (end == text || *end != '\0' || errno != 0 || !isfinite(value)) {
        return false;
    }
    *out = value;
    return true;
}

/* A non-negative value: decimal (fractions allowed) or 0x hexadecimal. */
static bool parse_number(const char *text, double *out)
{
    if (text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) {
        char *end;
        errno = 0;
        unsigned long long value = strtoull(text + 2, &end, 16);
        if (end == text + 2 || *end != '\0' || errno != 0 || value > (1ULL << 53)) {
            return false;
        }
        *out = (double)value;
        return true;
    }
    if (text[0] == '-' || text[0] == '+') {
        return false;
    }
    return parse_double(text, out);
}

static bool parse_index(const struct parser *p, const char *text, unsigned int *out)
{
    double value;
    if (!parse_number(text, &value) || value != floor(value) || value >= FAKE_MAX_DEVICES) {
        report(p, "bad device index '%s' (an integer 0..%d)", text, FAKE_MAX_DEVICES - 1);
        return false;
    }
    *out = (unsigned int)value;
    return true;
}

static bool parse_declared_device(const struct parser *p, const char *text, struct device **out)
{
    unsigned int index;
    if (!parse_index(p, text, &index)) {
        return false;
    }
    if (index >= p->scenario->device_count) {
        report(p, "device %u is not declared (declare it with a 'device %u ...' line first)",
               index, index);
        return false;
    }
    *out = &p->scenario->devices[index];
    return true;
}

/* `P` (a declared device) or `P:I` (MIG device I of parent P, declared by a `mig` line): the
 * schedule that `fault` and `process` lines of that target add to. */
static bool parse_target(const struct parser *p, const char *text, struct schedule **out)
{
    char parent_text[32];
    const char *colon = strchr(text, ':');
    struct device *device;
    if (colon == NULL) {
        if (!parse_declared_device(p, text, &device)) {
            return false;
        }
        *out = &device->schedule;
        return true;
    }
    size_t length = (size_t)(colon - text);
    double mig;
    if (length == 0 || length >= sizeof parent_text || !parse_number(colon + 1, &mig) ||
        mig != floor(mig) || mig >= FAKE_MAX_MIG_DEVICES) {
        report(p, "bad device '%s' (an index, or PARENT:MIG_INDEX for a MIG device)", text);
        return false;
    }
    memcpy(parent_text, text, length);
    parent_text[length] = '\0';
    if (!parse_declared_device(p, parent_text, &device)) {
        return false;
    }
    if ((unsigned int)mig >= device->n_migs) {
        report(p, "MIG device %s is not declared (device %s has %u MIG devices; declare them "
                  "with 'mig' lines first)", text, parent_text, device->n_migs);
        return false;
    }
    *out = &device->migs[(unsigned int)mig].schedule;
    return true;
}

/* A scenario time in seconds; "-" gives `dash` (start of time or forever). */
static bool parse_time(const struct parser *p, const char *text, double dash, double *out)
{
    if (strcmp(text, "-") == 0 && !isnan(dash)) {
        *out = dash;
        return true;
    }
    if (!parse_number(text, out)) {
        report(p, "bad time '%s' (seconds >= 0%s)", text, isnan(dash) ? "" : " or '-'");
        return false;
    }
    return true;
}

static int find_key(const char *name)
{
    for (int key = 0; key < K_COUNT; key++) {
        if (strcmp(KEYS[key].name, name) == 0) {
            return key;
        }
    }
    return -1;
}

static bool parse_key_value(const struct parser *p, enum key key, const char *text, double *out)
{
    const struct key_info *info = &KEYS[key];
    double value;
    if (!parse_number(text, &value)) {
        report(p, "bad number '%s' for key '%s'", text, info->name);
        return false;
    }
    if (info->kind != KIND_PCT && value != floor(value)) {
        report(p, "key '%s' takes an integer, not '%s'", info->name, text);
        return false;
    }
    if (info->kind == KIND_U32 && value > 4294967295.0) {
        report(p, "value '%s' of key '%s' does not fit in 32 bits", text, info->name);
        return false;
    }
    if (info->kind == KIND_PCT && value > 100.0) {
        report(p, "key '%s' is a percentage, not '%s'", info->name, text);
        return false;
    }
    *out = value;
    return true;
}

static bool copy_string(const struct parser *p, const char *key, const char *value, char *dest,
                        size_t size)
{
    size_t length = strlen(value);
    if (length >= size) {
        report(p, "%s '%s' is too long (at most %zu characters)", key, value, size - 1);
        return false;
    }
    memcpy(dest, value, length + 1);
    return true;
}

static bool set_pci_bus_id(const struct parser *p, struct device *device, const char *value)
{
    unsigned int domain, bus, dev, function;
    int consumed = 0;
    if (sscanf(value, "%x:%x:%x.%x%n", &domain, &bus, &dev, &function, &consumed) != 4 ||
        value[consumed] != '\0' || bus > 0xFF || dev > 0x1F || function > 7 ||
        strchr(value, '-') != NULL || strchr(value, '+') != NULL) {
        report(p, "bad pci_bus_id '%s' (expected DOMAIN:BUS:DEVICE.FUNCTION in hex, such as "
                  "00000000:17:00.0)", value);
        return false;
    }
    device->pci_domain = domain;
    device->pci_bus = bus;
    device->pci_device = dev;
    device->pci_function = function;
    return true;
}

/* One item of a CPU list, `N` or `N-M`, at *cursor; advances past it. */
static bool parse_cpu_range(const char **cursor, unsigned long *first, unsigned long *last)
{
    char *end;
    if (!isdigit((unsigned char)**cursor)) {
        return false;
    }
    errno = 0;
    *first = *last = strtoul(*cursor, &end, 10);
    if (*end == '-') {
        if (!isdigit((unsigned char)end[1])) {
            return false;
        }
        *last = strtoul(end + 1, &end, 10);
    }
    *cursor = end;
    return errno == 0 && *first <= *last && *last < FAKE_MAX_CPUS;
}

/* A Linux CPU list such as 0-3,8,10-11. */
static bool set_cpu_affinity(const struct parser *p, struct device *device, const char *value)
{
    uint64_t cpus[FAKE_CPU_WORDS] = {0};
    const char *cursor = value;
    for (;;) {
        unsigned long first, last;
        if (!parse_cpu_range(&cursor, &first, &last) || (*cursor != ',' && *cursor != '\0')) {
            report(p, "bad cpu_affinity '%s' (a CPU list such as 0-3,8,10-11, CPUs below %d)",
                   value, FAKE_MAX_CPUS);
            return false;
        }
        for (unsigned long cpu = first; cpu <= last; cpu++) {
            cpus[cpu / 64] |= 1ULL << (cpu % 64);
        }
        if (*cursor++ == '\0') {
            break;
        }
    }
    memcpy(device->cpu_affinity, cpus, sizeof cpus);
    device->cpu_affinity_set = true;
    return true;
}

/* A string property or a numeric key with its t=0 value, from a device line. */
static bool set_device_property(const struct parser *p, struct device *device, const char *key,
                                const char *value)
{
    if (strcmp(key, "name") == 0) {
        return copy_string(p, key, value, device->name, sizeof device->name);
    }
    if (strcmp(key, "uuid") == 0) {
        return copy_string(p, key, value, device->uuid, sizeof device->uuid);
    }
    if (strcmp(key, "serial") == 0) {
        return copy_string(p, key, value, device->serial, sizeof device->serial);
    }
    if (strcmp(key, "vbios_version") == 0) {
        return copy_string(p, key, value, device->vbios_version, sizeof device->vbios_version);
    }
    if (strcmp(key, "board_part_number") == 0) {
        return copy_string(p, key, value, device->board_part_number,
                           sizeof device->board_part_number);
    }
    if (strcmp(key, "pci_bus_id") == 0) {
        return set_pci_bus_id(p, device, value);
    }
    if (strcmp(key, "cpu_affinity") == 0) {
        return set_cpu_affinity(p, device, value);
    }
    int numeric = find_key(key);
    if (numeric < 0) {
        report(p, "unknown device key '%s'", key);
        return false;
    }
    double parsed;
    if (!parse_key_value(p, (enum key)numeric, value, &parsed)) {
        return false;
    }
    if (numeric == K_MIG_MODE && (parsed > 1 || (parsed == 0 && device->n_migs > 0))) {
        report(p, "mig_mode is 0 or 1, and stays 1 once 'mig' lines have declared MIG devices");
        return false;
    }
    if (numeric == K_NUMA_NODE && parsed > 2147483647.0) {
        report(p, "numa_node '%s' does not fit in an int", value);
        return false;
    }
    if (numeric == K_MAX_MIG_DEVICES &&
        (parsed > FAKE_MAX_MIG_DEVICES || parsed < device->n_migs)) {
        report(p, "max_mig_devices is at most %d and at least the MIG devices already declared "
                  "(%u)", FAKE_MAX_MIG_DEVICES, device->n_migs);
        return false;
    }
    device->series[numeric].base = parsed;
    device->series[numeric].set = true;
    return true;
}

static void init_device(struct device *device, unsigned int index)
{
    memset(device, 0, sizeof *device);
    snprintf(device->name, sizeof device->name, "NVIDIA H100 80GB HBM3");
    snprintf(device->uuid, sizeof device->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", index);
    snprintf(device->serial, sizeof device->serial, "16520230%05u", index);
    snprintf(device->vbios_version, sizeof device->vbios_version, "96.00.99.00.01");
    snprintf(device->board_part_number, sizeof device->board_part_number,
             "692-2G520-0200-000");
    size_t known = sizeof DEFAULT_PCI_BUS / sizeof DEFAULT_PCI_BUS[0];
    device->pci_bus = index < known ? DEFAULT_PCI_BUS[index] : 0x10 + index;
    for (int key = 0; key < K_COUNT; key++) {
        device->series[key].base = KEYS[key].default_value;
    }
}

static bool directive_set(struct parser *p, char **tokens, int count)
{
    struct scenario *s = p->scenario;
    if (count != 3) {
        report(p, "usage: set NAME VALUE");
        return false;
    }
    const char *name = tokens[1];
    const char *value = tokens[2];
    if (strcmp(name, "time_scale") == 0) {
        if (!parse_number(value, &s->time_scale) || s->time_scale <= 0) {
            report(p, "bad time_scale '%s' (scenario seconds per real second, > 0)", value);
            return false;
        }
        return true;
    }
    if (strcmp(name, "driver_version") == 0) {
        return copy_string(p, name, value, s->driver_version, sizeof s->driver_version);
    }
    if (strcmp(name, "nvml_version") == 0) {
        return copy_string(p, name, value, s->nvml_version, sizeof s->nvml_version);
    }
    if (strcmp(name, "cuda_driver_version") == 0) {
        double version;
        if (!parse_number(value, &version) || version != floor(version) || version > 1e9) {
            report(p, "bad cuda_driver_version '%s' (an integer such as 12040)", value);
            return false;
        }
        s->cuda_driver_version = (int)version;
        return true;
    }
    report(p, "unknown setting '%s' (time_scale, driver_version, nvml_version, "
              "cuda_driver_version)", name);
    return false;
}

static bool directive_device(struct parser *p, char **tokens, int count)
{
    struct scenario *s = p->scenario;
    unsigned int index;
    if (count < 2 || count % 2 != 0) {
        report(p, "usage: device INDEX [KEY VALUE]...");
        return false;
    }
    if (!parse_index(p, tokens[1], &index)) {
        return false;
    }
    if (index > s->device_count) {
        report(p, "devices must be declared in order 0..N-1: expected device %u, got %u",
               s->device_count, index);
        return false;
    }
    if (index == s->device_count) {
        init_device(&s->devices[index], index);
        s->device_count++;
    }
    for (int i = 2; i < count; i += 2) {
        if (!set_device_property(p, &s->devices[index], tokens[i], tokens[i + 1])) {
            return false;
        }
    }
    return true;
}

static bool add_step(struct series *series, double t, double value)
{
    if (!grow((void **)&series->steps, &series->cap, series->n, sizeof *series->steps)) {
        return false;
    }
    /* Stable: a later line with the same time comes after, and so wins. */
    size_t at = series->n;
    while (at > 0 && series->steps[at - 1].t > t) {
        series->steps[at] = series->steps[at - 1];
        at--;
    }
    series->steps[at] = (struct step){t, value};
    series->n++;
    series->set = true;
    return true;
}

static bool directive_at(struct parser *p, char **tokens, int count)
{
    double t;
    struct device *device;
    if (count < 5 || count % 2 != 1) {
        report(p, "usage: at TIME DEVICE KEY VALUE [KEY VALUE]...");
        return false;
    }
    if (!parse_time(p, tokens[1], NAN, &t) || !parse_declared_device(p, tokens[2], &device)) {
        return false;
    }
    for (int i = 3; i < count; i += 2) {
        int key = find_key(tokens[i]);
        double value;
        if (key < 0) {
            report(p, "unknown key '%s'", tokens[i]);
            return false;
        }
        if (KEYS[key].is_static) {
            report(p, "key '%s' is static: set it on the device line", tokens[i]);
            return false;
        }
        if (!parse_key_value(p, (enum key)key, tokens[i + 1], &value)) {
            return false;
        }
        if (!add_step(&device->series[key], t, value)) {
            report(p, "out of memory");
            return false;
        }
    }
    return true;
}

static const struct {
    const char *name;
    nvmlReturn_t code;
} FAULT_KINDS[] = {
    {"lost", NVML_ERROR_GPU_IS_LOST},
    {"unsupported", NVML_ERROR_NOT_SUPPORTED},
    {"no_permission", NVML_ERROR_NO_PERMISSION},
    {"timeout", NVML_ERROR_TIMEOUT},
    {"unknown", NVML_ERROR_UNKNOWN},
    {"invalid_argument", NVML_ERROR_INVALID_ARGUMENT},
};

static bool parse_fault_target(const struct parser *p, const char *text, struct fault *fault)
{
    if (strncmp(text, "field:", 6) == 0) {
        double id;
        if (!parse_number(text + 6, &id) || id != floor(id) || id >= 4294967295.0) {
            report(p, "bad field id in '%s' (field:N, N a NVML_FI_* number)", text);
            return false;
        }
        fault->fn = FN_nvmlDeviceGetFieldValues;
        fault->field_id = (uint32_t)id;
        return true;
    }
    for (int fn = 0; fn < FN_COUNT; fn++) {
        if (strcmp(FN_NAMES[fn], text) == 0) {
            fault->fn = (enum fn)fn;
            return true;
        }
    }
    report(p, "unknown function '%s' (a device function the fake implements, or field:N)",
           text);
    return false;
}

static bool directive_fault(struct parser *p, char **tokens, int count)
{
    struct schedule *schedule;
    struct fault fault = {.field_id = FAKE_NO_FIELD};
    if (count != 6) {
        report(p, "usage: fault DEVICE|PARENT:MIG KIND FUNCTION|field:N|- START|- END|-");
        return false;
    }
    if (!parse_target(p, tokens[1], &schedule)) {
        return false;
    }
    size_t kinds = sizeof FAULT_KINDS / sizeof FAULT_KINDS[0];
    size_t kind = 0;
    while (kind < kinds && strcmp(FAULT_KINDS[kind].name, tokens[2]) != 0) {
        kind++;
    }
    if (kind == kinds) {
        report(p, "unknown fault kind '%s' (lost, unsupported, no_permission, timeout, unknown, "
               "invalid_argument)",
               tokens[2]);
        return false;
    }
    fault.code = FAULT_KINDS[kind].code;
    fault.lost = fault.code == NVML_ERROR_GPU_IS_LOST;
    if (fault.lost) {
        if (strcmp(tokens[3], "-") != 0) {
            report(p, "a 'lost' fault applies to every call: its function must be '-'");
            return false;
        }
    } else if (!parse_fault_target(p, tokens[3], &fault)) {
        return false;
    }
    if (!parse_time(p, tokens[4], -INFINITY, &fault.start) ||
        !parse_time(p, tokens[5], INFINITY, &fault.end)) {
        return false;
    }
    if (fault.end <= fault.start) {
        report(p, "the fault window ends before it starts");
        return false;
    }
    if (!grow((void **)&schedule->faults, &schedule->cap_faults, schedule->n_faults,
              sizeof *schedule->faults)) {
        report(p, "out of memory");
        return false;
    }
    schedule->faults[schedule->n_faults++] = fault;
    return true;
}

static bool directive_xid(struct parser *p, char **tokens, int count)
{
    struct device *device;
    double t, xid;
    if (count != 4) {
        report(p, "usage: xid DEVICE TIME XID");
        return false;
    }
    if (!parse_declared_device(p, tokens[1], &device) || !parse_time(p, tokens[2], NAN, &t)) {
        return false;
    }
    if (!parse_number(tokens[3], &xid) || xid != floor(xid)) {
        report(p, "bad XID '%s' (an integer such as 79)", tokens[3]);
        return false;
    }
    if (!grow((void **)&device->xids, &device->cap_xids, device->n_xids, sizeof *device->xids)) {
        report(p, "out of memory");
        return false;
    }
    size_t at = device->n_xids;
    while (at > 0 && device->xids[at - 1].t > t) {
        device->xids[at] = device->xids[at - 1];
        at--;
    }
    device->xids[at] = (struct xid){t, (unsigned long long)xid};
    device->n_xids++;
    return true;
}

static bool directive_upgrade(struct parser *p, char **tokens, int count)
{
    struct scenario *s = p->scenario;
    double t;
    if (count != 3) {
        report(p, "usage: upgrade TIME DRIVER_VERSION");
        return false;
    }
    if (!parse_time(p, tokens[1], NAN, &t)) {
        return false;
    }
    s->upgrade_t = t;
    return copy_string(p, "driver_version", tokens[2], s->upgraded_version,
                       sizeof s->upgraded_version);
}

static bool directive_hang(struct parser *p, char **tokens, int count)
{
    struct scenario *s = p->scenario;
    if (count != 3) {
        report(p, "usage: hang START|- END|-");
        return false;
    }
    if (!parse_time(p, tokens[1], -INFINITY, &s->hang_start) ||
        !parse_time(p, tokens[2], INFINITY, &s->hang_end)) {
        return false;
    }
    if (s->hang_end <= s->hang_start) {
        report(p, "hang END must be after START");
        return false;
    }
    return true;
}

static bool directive_process(struct parser *p, char **tokens, int count)
{
    struct schedule *schedule;
    double pid, bytes;
    struct process process;
    if (count != 6) {
        report(p, "usage: process DEVICE|PARENT:MIG PID USED_BYTES START|- END|-");
        return false;
    }
    if (!parse_target(p, tokens[1], &schedule)) {
        return false;
    }
    if (!parse_number(tokens[2], &pid) || pid != floor(pid) || pid < 1 || pid > 4294967295.0) {
        report(p, "bad pid '%s'", tokens[2]);
        return false;
    }
    if (!parse_number(tokens[3], &bytes) || bytes != floor(bytes)) {
        report(p, "bad used memory '%s' (bytes)", tokens[3]);
        return false;
    }
    if (!parse_time(p, tokens[4], -INFINITY, &process.start) ||
        !parse_time(p, tokens[5], INFINITY, &process.end)) {
        return false;
    }
    process.pid = (unsigned int)pid;
    process.used_bytes = (unsigned long long)bytes;
    if (!grow((void **)&schedule->processes, &schedule->cap_processes, schedule->n_processes,
              sizeof *schedule->processes)) {
        report(p, "out of memory");
        return false;
    }
    schedule->processes[schedule->n_processes++] = process;
    return true;
}

static bool parse_instance_id(const struct parser *p, const char *what, const char *text,
                              unsigned int *out)
{
    double id;
    if (!parse_number(text, &id) || id != floor(id) || id >= NVML_VALUE_NOT_AVAILABLE_UINT) {
        report(p, "bad %s '%s' (an integer below 0xFFFFFFFF)", what, text);
        return false;
    }
    *out = (unsigned int)id;
    return true;
}

static bool directive_mig(struct parser *p, char **tokens, int count)
{
    struct device *parent;
    struct mig_device mig = {0};
    double bytes;
    if (count != 6) {
        report(p, "usage: mig PARENT GI_ID CI_ID UUID MEMORY_TOTAL_BYTES");
        return false;
    }
    if (!parse_declared_device(p, tokens[1], &parent) ||
        !parse_instance_id(p, "GPU instance id", tokens[2], &mig.gpu_instance_id) ||
        !parse_instance_id(p, "compute instance id", tokens[3], &mig.compute_instance_id) ||
        !copy_string(p, "uuid", tokens[4], mig.uuid, sizeof mig.uuid)) {
        return false;
    }
    if (strncmp(mig.uuid, "MIG-", 4) != 0) {
        report(p, "a MIG device's uuid starts with 'MIG-', not '%s'", mig.uuid);
        return false;
    }
    if (!parse_number(tokens[5], &bytes) || bytes != floor(bytes)) {
        report(p, "bad memory total '%s' (bytes)", tokens[5]);
        return false;
    }
    mig.memory_total_bytes = (unsigned long long)bytes;
    if (parent->series[K_MIG_MODE].base != 1) {
        report(p, "device %s is not in MIG mode (set mig_mode 1 on a device line before this one)",
               tokens[1]);
        return false;
    }
    if (parent->n_migs >= parent->series[K_MAX_MIG_DEVICES].base) {
        report(p, "device %s already has max_mig_devices (%u) MIG devices", tokens[1],
               parent->n_migs);
        return false;
    }
    for (unsigned int d = 0; d < p->scenario->device_count; d++) {
        const struct device *other = &p->scenario->devices[d];
        for (unsigned int i = 0; i < other->n_migs; i++) {
            if (strcmp(other->migs[i].uuid, mig.uuid) == 0) {
                report(p, "MIG uuid %s is already MIG device %u:%u", mig.uuid, d, i);
                return false;
            }
            if (other == parent && other->migs[i].gpu_instance_id == mig.gpu_instance_id &&
                other->migs[i].compute_instance_id == mig.compute_instance_id) {
                report(p, "device %u already has GPU instance %u, compute instance %u (MIG "
                          "device %u:%u)", d, mig.gpu_instance_id, mig.compute_instance_id, d, i);
                return false;
            }
        }
    }
    parent->migs[parent->n_migs++] = mig;
    return true;
}

static bool parse_line(struct parser *p, char *line)
{
    char *tokens[MAX_TOKENS];
    int count = tokenize(p, line, tokens);
    if (count <= 0) {
        return count == 0;
    }
    const char *directive = tokens[0];
    if (strcmp(directive, "set") == 0) {
        return directive_set(p, tokens, count);
    }
    if (strcmp(directive, "device") == 0) {
        return directive_device(p, tokens, count);
    }
    if (strcmp(directive, "at") == 0) {
        return directive_at(p, tokens, count);
    }
    if (strcmp(directive, "fault") == 0) {
        return directive_fault(p, tokens, count);
    }
    if (strcmp(directive, "xid") == 0) {
        return directive_xid(p, tokens, count);
    }
    if (strcmp(directive, "upgrade") == 0) {
        return directive_upgrade(p, tokens, count);
    }
    if (strcmp(directive, "hang") == 0) {
        return directive_hang(p, tokens, count);
    }
    if (strcmp(directive, "process") == 0) {
        return directive_process(p, tokens, count);
    }
    if (strcmp(directive, "mig") == 0) {
        return directive_mig(p, tokens, count);
    }
    report(p, "unknown directive '%s' (set, device, at, fault, xid, process, upgrade, mig, "
           "hang)",
           directive);
    return false;
}

struct scenario *scenario_load(const char *path)
{
    struct parser p = {.path = path, .line = 0, .scenario = NULL};
    FILE *file = fopen(path, "r");
    if (file == NULL) {
        fprintf(stderr, "fakenvml: %s: cannot open scenario: %s\n", path, strerror(errno));
        return NULL;
    }
    struct scenario *s = calloc(1, sizeof *s);
    if (s == NULL) {
        fclose(file);
        fprintf(stderr, "fakenvml: %s: out of memory\n", path);
        return NULL;
    }
    s->time_scale = 1.0;
    s->upgrade_t = INFINITY;
    s->hang_start = INFINITY;
    s->hang_end = INFINITY;
    snprintf(s->driver_version, sizeof s->driver_version, "550.54.15");
    snprintf(s->nvml_version, sizeof s->nvml_version, "12.550.54.15");
    s->cuda_driver_version = 12040;
    p.scenario = s;

    char *line = NULL;
    size_t line_cap = 0;
    bool ok = true;
    while (ok) {
        errno = 0;
        if (getline(&line, &line_cap, file) < 0) {
            if (errno != 0) {
                fprintf(stderr, "fakenvml: %s: read error: %s\n", path, strerror(errno));
                ok = false;
            }
            break;
        }
        p.line++;
        ok = parse_line(&p, line);
    }
    free(line);
    fclose(file);
    if (!ok) {
        scenario_free(s);
        return NULL;
    }
    return s;
}

void scenario_free(struct scenario *scenario)
{
    if (scenario == NULL) {
        return;
    }
    for (unsigned int i = 0; i < scenario->device_count; i++) {
        struct device *device = &scenario->devices[i];
        for (int key = 0; key < K_COUNT; key++) {
            free(device->series[key].steps);
        }
        free(device->schedule.faults);
        free(device->schedule.processes);
        free(device->xids);
        for (unsigned int m = 0; m < device->n_migs; m++) {
            free(device->migs[m].schedule.faults);
            free(device->migs[m].schedule.processes);
        }
    }
    free(scenario);
}

static double series_value(const struct series *series, double t)
{
    double value = series->base;
    for (size_t i = 0; i < series->n && series->steps[i].t <= t; i++) {
        value = series->steps[i].value;
    }
    return value;
}

double device_value(const struct device *device, enum key key, double t)
{
    if (key == K_GRAPHICS_CLOCK_MHZ && !device->series[key].set) {
        key = K_SM_CLOCK_MHZ; /* one clock domain on data-centre parts */
    }
    if (key == K_POWER_AVERAGE_MW && !device->series[key].set) {
        key = K_POWER_MW; /* a steady draw averages to itself */
    }
    return series_value(&device->series[key], t);
}

/* Integral over [0, t] of weight(value) for a step function; exact for piecewise constants. */
static double series_integral(const struct series *series, double t,
                              double (*weight)(double value, uint64_t mask), uint64_t mask)
{
    double total = 0;
    double from = 0;
    double value = series->base;
    for (size_t i = 0; i < series->n && series->steps[i].t <= t; i++) {
        if (series->steps[i].t > from) {
            total += weight(value, mask) * (series->steps[i].t - from);
            from = series->steps[i].t;
        }
        value = series->steps[i].value;
    }
    if (t > from) {
        total += weight(value, mask) * (t - from);
    }
    return total;
}

static double identity(double value, uint64_t mask)
{
    (void)mask;
    return value;
}

static double masked(double value, uint64_t mask)
{
    return ((uint64_t)value & mask) != 0 ? 1.0 : 0.0;
}

double device_energy_mj(const struct device *device, double t)
{
    /* mW * s = mJ */
    return device->series[K_ENERGY_MJ].base +
           series_integral(&device->series[K_POWER_MW], t, identity, 0);
}

double device_reason_seconds(const struct device *device, uint64_t mask, double t)
{
    return series_integral(&device->series[K_REASONS], t, masked, mask);
}

static nvmlReturn_t schedule_fault(const struct schedule *schedule, enum fn fn, double t)
{
    nvmlReturn_t code = NVML_SUCCESS;
    for (size_t i = 0; i < schedule->n_faults; i++) {
        const struct fault *fault = &schedule->faults[i];
        if (t < fault->start || t >= fault->end) {
            continue;
        }
        if (fault->lost) {
            return NVML_ERROR_GPU_IS_LOST;
        }
        if (code == NVML_SUCCESS && fault->fn == fn && fault->field_id == FAKE_NO_FIELD) {
            code = fault->code;
        }
    }
    return code;
}

nvmlReturn_t device_fault(const struct device *device, enum fn fn, double t)
{
    return schedule_fault(&device->schedule, fn, t);
}

nvmlReturn_t mig_fault(const struct device *parent, const struct mig_device *mig, enum fn fn,
                       double t)
{
    for (size_t i = 0; i < parent->schedule.n_faults; i++) {
        const struct fault *fault = &parent->schedule.faults[i];
        if (fault->lost && t >= fault->start && t < fault->end) {
            return NVML_ERROR_GPU_IS_LOST;
        }
    }
    return schedule_fault(&mig->schedule, fn, t);
}

bool process_running(const struct process *process, double t)
{
    return t >= process->start && t < process->end;
}

nvmlReturn_t device_field_fault(const struct device *device, uint32_t field_id, double t)
{
    for (size_t i = 0; i < device->schedule.n_faults; i++) {
        const struct fault *fault = &device->schedule.faults[i];
        if (fault->field_id == field_id && t >= fault->start && t < fault->end) {
            return fault->code;
        }
    }
    return NVML_SUCCESS;
}
