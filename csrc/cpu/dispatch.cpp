// Runtime ISA dispatch of the CPU kernel, the way ATen's CPU_CAPABILITY does it: the kernel's
// translation units are compiled once per level into this extension (setup.py), and the first
// call picks the best level the CPU supports (cpuid, and xgetbv for the OS-enabled register
// state; auto_level has the one vendor exception), or the level RINGSEQ_CPU_ISA forces. The
// choice is cached in one atomic pointer; the first resolution runs under a mutex, so
// concurrent first calls agree.
//
// This unit is compiled for the baseline target only (it runs on every CPU); it is also where
// the per-level units reach torch (isa.h hooks).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "flash_cpu.h"
#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define RINGSEQ_X86 1
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ringseq {
namespace cpu {

int hook_num_threads() { return at::get_num_threads(); }

void hook_parallel(int64_t nthreads, void (*body)(void*), void* ctx) {
  at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body(ctx);
  });
}

void hook_fail(const char* what, int64_t bytes) {
  if (bytes > 0) TORCH_CHECK(false, what, " (", bytes, " bytes)");
  TORCH_CHECK(false, what);
}

namespace {
// 9 MiB holds one head's K and V (forward) or Q and dO (backward) in float32 up to 8192 rows at
// d = 128 at their padded row stride (common.h: packed_ld; 8192 x (512 + 576) or 2 x 576 bytes),
// and stays small next to the inputs on a many-core machine (64 threads: 576 MiB).
std::atomic<int64_t> g_head_rows_bytes{int64_t(9) << 20};
}  // namespace

int64_t hook_head_rows_bytes() { return g_head_rows_bytes.load(std::memory_order_relaxed); }

int64_t head_rows_bytes(int64_t value) {
  return value >= 0 ? g_head_rows_bytes.exchange(value) : g_head_rows_bytes.load();
}

namespace {

enum Level : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4, kNumLevels = 5 };

struct LevelInfo {
  const char* name;
  const KernelTable* (*table)();  // nullptr: not built
  const char* requires_;          // what the CPU must have, for error messages
};

constexpr const char* kAmxRequires =
    "what avx512bf16 needs plus AMX-TILE and AMX-BF16 with OS support for tile state, granted to "
    "the process (Linux 5.16 or later: arch_prctl ARCH_REQ_XCOMP_PERM)";

const LevelInfo kLevels[kNumLevels] = {
    {"baseline", &baseline::kernel_table, "nothing beyond the build target"},
#if defined(RINGSEQ_CPU_HAVE_AVX2)
    {"avx2", &avx2::kernel_table, "AVX2, FMA and F16C with OS support for YMM state"},
#else
    {"avx2", nullptr, "AVX2, FMA and F16C with OS support for YMM state"},
#endif
#if defined(RINGSEQ_CPU_HAVE_AVX512)
    {"avx512", &avx512::kernel_table,
     "AVX-512 F, BW, DQ and VL plus AVX2/FMA/F16C with OS support for ZMM state"},
#else
    {"avx512", nullptr, "AVX-512 F, BW, DQ and VL plus AVX2/FMA/F16C with OS support for ZMM state"},
#endif
#if defined(RINGSEQ_CPU_HAVE_AVX512BF16)
    {"avx512bf16", &avx512bf16::kernel_table, "what avx512 needs plus AVX512_BF16"},
#else
    {"avx512bf16", nullptr, "what avx512 needs plus AVX512_BF16"},
#endif
#if defined(RINGSEQ_CPU_HAVE_AMX)
    {"amx", &amx::kernel_table, kAmxRequires},
#else
    {"amx", nullptr, kAmxRequires},
#endif
};

// Every level's name, "baseline, avx2, ..." (error messages).
std::string level_names() {
  std::string out;
  for (int i = 0; i < kNumLevels; ++i) out += std::string(i ? ", " : "") + kLevels[i].name;
  return out;
}

#if defined(RINGSEQ_X86)
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Whether this process may use the AMX tile data state: Linux enables it in XCR0 but grants
// it per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 18; a
// tile instruction without it faults). Asked at every detection; asking again is harmless.
bool amx_permitted(uint64_t xcr0) {
  if ((xcr0 & 0x60000) != 0x60000) return false;  // XTILECFG and XTILEDATA
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
  return false;
#endif
}
#endif

// The highest level this CPU (and its OS) can run, from cpuid.
int detect_cpu_level() {
#if defined(RINGSEQ_X86)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kBaseline;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!(osxsave && avx)) return kBaseline;
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return kBaseline;  // XMM and YMM state
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return kBaseline;
  __cpuid_count(7, 0, a7, b7, c7, d7);
  const bool avx2 = b7 & (1u << 5);
  if (!(avx2 && fma && f16c)) return kBaseline;
  const bool avx512 = (b7 & (1u << 16)) && (b7 & (1u << 17)) && (b7 & (1u << 30)) &&
                      (b7 & (1u << 31));  // F, DQ, BW, VL
  if (!(avx512 && (xcr0 & 0xe6) == 0xe6)) return kAvx2;  // + opmask, ZMM_Hi256, Hi16_ZMM
  unsigned a71 = 0, b71 = 0, c71 = 0, d71 = 0;
  if (a7 >= 1) __cpuid_count(7, 1, a71, b71, c71, d71);  // a7: the highest subleaf of leaf 7
  if (!(a71 & (1u << 5))) return kAvx512;  // AVX512_BF16
  const bool amx = (d7 & (1u << 22)) && (d7 & (1u << 24));  // AMX-BF16, AMX-TILE
  // Only asked where the level is built: the request changes the process's signal frames.
  return amx && kLevels[kAmx].table && amx_permitted(xcr0) ? kAmx : kAvx512Bf16;
#else
  return kBaseline;
#endif
}

int level_by_name(const std::string& name) {
  for (int i = 0; i < kNumLevels; ++i)
    if (name == kLevels[i].name) return i;
  return -1;
}

std::string trimmed_lower(const char* s) {
  std::string out;
  for (const char* p = s; *p; ++p)
    if (*p != ' ' && *p != '\t') out += static_cast<char>(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
  return out;
}

// What the CPU supports, capped by RINGSEQ_CPU_ISA_CEILING (read with RINGSEQ_CPU_ISA; a test
// knob that makes a machine pretend to lack the levels above it).
int supported_level(std::string* error) {
  int level = detect_cpu_level();
  const char* ceiling = std::getenv("RINGSEQ_CPU_ISA_CEILING");
  if (ceiling && *ceiling) {
    const int c = level_by_name(trimmed_lower(ceiling));
    if (c < 0) {
      *error = "RINGSEQ_CPU_ISA_CEILING must be one of " + level_names() + "; got '" + ceiling + "'";
      return -1;
    }
    level = c < level ? c : level;
  }
  return level;
}

std::string level_list(int max_level, bool built_only) {
  std::string out;
  for (int i = 0; i <= max_level && i < kNumLevels; ++i) {
    if (built_only && kLevels[i].table == nullptr) continue;
    if (!out.empty()) out += ",";
    out += kLevels[i].name;
  }
  return out;
}

// The cpuid vendor string ("GenuineIntel", "AuthenticAMD", ...; "" off x86).
std::string cpu_vendor() {
#if defined(RINGSEQ_X86)
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return std::string();
  char v[13];
  std::memcpy(v, &b, 4);
  std::memcpy(v + 4, &d, 4);
  std::memcpy(v + 8, &c, 4);
  v[12] = '\0';
  return v;
#else
  return std::string();
#endif
}

// The level `auto` runs: the highest one this CPU supports and this build has, except where a
// level was measured slower than the one below it on a vendor's cores (tuning as data: one row
// per case; RINGSEQ_CPU_ISA still forces any level).
struct AutoException {
  int level;           // the CPU's highest level ...
  const char* vendor;  // ... on a CPU of this cpuid vendor ...
  int instead;         // ... runs this one under auto (when built)
};
// avx512bf16 on Intel: vdpbf16ps issues once per ~2 cycles on a Sapphire Rapids-class Xeon
// (measured: 1.1-1.2e9/s per core against 4.2-4.5e9 512-bit FMAs/s), half the FMAs' float
// rate, and that level's bf16 attention ran 1.3-1.4x slower than avx512's, fwd and fwd+bwd
// (benchmarks/RESULTS.md). On AMD Zen 4 (1/cycle on 256-bit halves) it is 15-23 % faster.
const AutoException kAutoExceptions[] = {{kAvx512Bf16, "GenuineIntel", kAvx512}};

int auto_level(int supported, const std::string& vendor) {
  int start = supported;
  for (const AutoException& e : kAutoExceptions)
    if (e.level == supported && vendor == e.vendor && kLevels[e.instead].table) start = e.instead;
  for (int i = start; i >= 0; --i)
    if (kLevels[i].table) return i;
  return -1;
}

// Resolves the level to use from the CPU and `request` ("" or "auto": auto_level).
const KernelTable* resolve(const std::string& request, const char* source, std::string* error) {
  const int cpu = supported_level(error);
  if (cpu < 0) return nullptr;
  if (request.empty() || request == "auto") {
    const int level = auto_level(cpu, cpu_vendor());
    if (level >= 0) return kLevels[level].table();
    *error = "ringseq CPU kernel: no ISA level was built";
    return nullptr;
  }
  const int want = level_by_name(request);
  if (want < 0) {
    *error = std::string(source) + " must be one of auto, " + level_names() + "; got '" + request + "'";
    return nullptr;
  }
  if (kLevels[want].table == nullptr) {
    *error = std::string(source) + "=" + request + " but this build of ringseq has no " + request +
             " kernels (levels built: " + level_list(kNumLevels - 1, true) +
             "); rebuild on x86-64 with a compiler that accepts the level's flags";
    return nullptr;
  }
  if (want > cpu) {
    *error = std::string(source) + "=" + request + " but this CPU cannot run it (it needs " +
             kLevels[want].requires_ + "); levels this CPU supports: " + level_list(cpu, true) +
             ". Unset " + source + " to let auto choose.";
    return nullptr;
  }
  return kLevels[want].table();
}

std::mutex g_mu;
std::atomic<const KernelTable*> g_table{nullptr};
std::string g_error;  // the first resolution's error, under g_mu

const KernelTable* active_or_error(std::string* error) {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t) return t;
  std::lock_guard<std::mutex> lock(g_mu);
  t = g_table.load(std::memory_order_relaxed);
  if (t) return t;
  if (g_error.empty()) {
    const char* env = std::getenv("RINGSEQ_CPU_ISA");
    t = resolve(env ? trimmed_lower(env) : std::string(), "RINGSEQ_CPU_ISA", &g_error);
    if (t) {
      g_table.store(t, std::memory_order_release);
      return t;
    }
  }
  *error = g_error;
  return nullptr;
}

const KernelTable& active() {
  std::string error;
  const KernelTable* t = active_or_error(&error);
  TORCH_CHECK(t != nullptr, error);
  return *t;
}

}  // namespace

bool isa_active(std::string* name, std::string* error) {
  const KernelTable* t = active_or_error(error);
  if (t) *name = t->name;
  return t != nullptr;
}

std::string isa_supported() {
  std::string error;
  const int cpu = supported_level(&error);
  return cpu < 0 ? std::string() : level_list(cpu, true);
}

std::string isa_built() { return level_list(kNumLevels - 1, true); }

std::string isa_auto(const std::string* vendor, const std::string* supported, std::string* error) {
  int cpu;
  if (supported) {
    cpu = level_by_name(trimmed_lower(supported->c_str()));
    if (cpu < 0) {
      *error = "_cpu_isa_auto(vendor, level): level must be one of " + level_names() + "; got '" + *supported + "'";
      return std::string();
    }
  } else {
    cpu = supported_level(error);
    if (cpu < 0) return std::string();
  }
  const int level = auto_level(cpu, vendor ? *vendor : cpu_vendor());
  if (level < 0) {
    *error = "ringseq CPU kernel: no ISA level was built";
    return std::string();
  }
  return kLevels[level].name;
}

bool isa_force(const std::string& request, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (request.empty()) {  // back to first-use resolution (RINGSEQ_CPU_ISA is read again)
    g_error.clear();
    g_table.store(nullptr, std::memory_order_release);
    return true;
  }
  const KernelTable* t = resolve(trimmed_lower(request.c_str()), "the requested CPU ISA level", error);
  if (!t) return false;
  g_error.clear();
  g_table.store(t, std::memory_order_release);
  return true;
}

}  // namespace cpu

void flash_fwd_cpu(const FwdParams& params) {
  // Single-token GQA decoding: each kv head's query heads become the rows of one tile.
  cpu::active().fwd(gqa_rows_possible(params) ? gqa_rows_view(params) : params);
}

void flash_bwd_cpu(const BwdParams& params) { cpu::active().bwd(params); }

void flash_delta_cpu(const BwdParams& params, void* delta) { cpu::active().delta(params, delta); }

void softmax_exp_cpu(const float* x, float* y, int64_t n, bool non_positive) {
  cpu::active().exp(x, y, n, non_positive);
}

}  // namespace ringseq
