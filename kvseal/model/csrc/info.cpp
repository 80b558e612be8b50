// What this build of the kernels is: its level (setup.py defines KVSEAL_LEVEL per library) and the compiler
// that built it, for the start line and `kvseal env`.
#ifndef KVSEAL_LEVEL
#define KVSEAL_LEVEL "unknown"
#endif

extern "C" {
const char* kvseal_level() { return KVSEAL_LEVEL; }
const char* kvseal_compiler() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "g++ " __VERSION__;
#else
  return "unknown";
#endif
}
}  // extern "C"
