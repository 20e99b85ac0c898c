// Identifies a build: the kernel sources it was made from (loader.py compares this with the
// hash of the sources beside it and never uses a build of other sources), and the CPU
// features its compiler flags enabled, as /proc/cpuinfo names them (cpu.py compares the
// record written beside the library with the running CPU before loading; loader.py then
// checks that the record is this library's own). The table is cpu.py's FEATURE_MACROS.
#ifndef HVDC_SOURCE_HASH
#define HVDC_SOURCE_HASH "unknown"
#endif

extern "C" const char* hvdc_source_hash() { return HVDC_SOURCE_HASH; }

static const char kFeatures[] = ""
#ifdef __SSE3__
    " pni"
#endif
#ifdef __SSSE3__
    " ssse3"
#endif
#ifdef __SSE4_1__
    " sse4_1"
#endif
#ifdef __SSE4_2__
    " sse4_2"
#endif
#ifdef __CRC32__
    " sse4_2"
#endif
#ifdef __POPCNT__
    " popcnt"
#endif
#ifdef __LAHF_SAHF__
    " lahf_lm"
#endif
#ifdef __GCC_HAVE_SYNC_COMPARE_AND_SWAP_16
    " cx16"
#endif
#ifdef __SSE4A__
    " sse4a"
#endif
#ifdef __AVX__
    " avx"
#endif
#ifdef __AVX2__
    " avx2"
#endif
#ifdef __FMA__
    " fma"
#endif
#ifdef __FMA4__
    " fma4"
#endif
#ifdef __XOP__
    " xop"
#endif
#ifdef __F16C__
    " f16c"
#endif
#ifdef __BMI__
    " bmi1"
#endif
#ifdef __BMI2__
    " bmi2"
#endif
#ifdef __LZCNT__
    " abm"
#endif
#ifdef __ABM__
    " abm"
#endif
#ifdef __TBM__
    " tbm"
#endif
#ifdef __MOVBE__
    " movbe"
#endif
#ifdef __ADX__
    " adx"
#endif
#ifdef __PRFCHW__
    " 3dnowprefetch"
#endif
#ifdef __PCLMUL__
    " pclmulqdq"
#endif
#ifdef __AES__
    " aes"
#endif
#ifdef __SHA__
    " sha_ni"
#endif
#ifdef __GFNI__
    " gfni"
#endif
#ifdef __VAES__
    " vaes"
#endif
#ifdef __VPCLMULQDQ__
    " vpclmulqdq"
#endif
#ifdef __AVXVNNI__
    " avx_vnni"
#endif
#ifdef __AVX512F__
    " avx512f"
#endif
#ifdef __AVX512CD__
    " avx512cd"
#endif
#ifdef __AVX512BW__
    " avx512bw"
#endif
#ifdef __AVX512DQ__
    " avx512dq"
#endif
#ifdef __AVX512VL__
    " avx512vl"
#endif
#ifdef __AVX512IFMA__
    " avx512ifma"
#endif
#ifdef __AVX512VBMI__
    " avx512vbmi"
#endif
#ifdef __AVX512VBMI2__
    " avx512_vbmi2"
#endif
#ifdef __AVX512VNNI__
    " avx512_vnni"
#endif
#ifdef __AVX512BITALG__
    " avx512_bitalg"
#endif
#ifdef __AVX512VPOPCNTDQ__
    " avx512_vpopcntdq"
#endif
#ifdef __AVX512BF16__
    " avx512_bf16"
#endif
#ifdef __AVX512FP16__
    " avx512_fp16"
#endif
#ifdef __AVX512VP2INTERSECT__
    " avx512_vp2intersect"
#endif
    ;

// Space-separated, each flag with a leading space, possibly repeated (two macros name
// sse4_2 and abm); empty for a build that enables none of them.
extern "C" const char* hvdc_cpu_features() { return kFeatures; }
