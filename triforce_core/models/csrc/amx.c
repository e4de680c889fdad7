/* AMX's tiles as both libraries use them (q_k_tiles.c and q_k_steps.c in layers.c, integer_attention.c in
 * attention.c): whether this process may run them, and their one configuration.
 *
 * The tiles run only after the process asks the kernel for their state (arch_prctl
 * ARCH_REQ_XCOMP_PERM): without it the first tile instruction faults. A library asks once, after
 * the processor says it has what it needs (cpuid, the caller's check) and the system saves the
 * tiles' state (XCR0). Included by each library's main file, before the file that uses it.
 */
#ifndef TRIFORCE_AMX_C
#define TRIFORCE_AMX_C
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 11
#include <cpuid.h>
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_X86 1

/* Whether the system saves the tiles' state (XCR0 bits 17 TILECFG and 18 TILEDATA; with
 * `avx512`, AVX-512's too, bits 5-7) and grants it to this process; the processor's own cpuid
 * bits are the caller's to check first. */
static int amx_permitted(int avx512) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return 0; /* OSXSAVE: xgetbv runs */
    unsigned lo32, hi32;
    __asm__ volatile("xgetbv" : "=a"(lo32), "=d"(hi32) : "c"(0));
    if ((lo32 >> 17 & 3) != 3 || (avx512 && (lo32 & 0xe0u) != 0xe0u)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* cpuid leaf 7's EDX bit `bit` (22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8). */
static int amx_has(int bit) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> bit & 1);
}

struct amx_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* This thread's tiles 0-7, each 16 rows of 64 bytes (palette 1): every tile both libraries use. */
static __attribute__((target("amx-tile"))) void amx_configure(void) {
    struct amx_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}
#endif
#endif
