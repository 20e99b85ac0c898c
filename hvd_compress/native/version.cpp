// Identifies the kernel sources a build was made from: loader.py compares this with the
// hash of the sources beside it and never uses a build of other sources.
#ifndef HVDC_SOURCE_HASH
#define HVDC_SOURCE_HASH "unknown"
#endif

extern "C" const char* hvdc_source_hash() { return HVDC_SOURCE_HASH; }
