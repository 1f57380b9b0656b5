// Whether this test binary is a sanitizer build (scripts/sanitize.sh: clang with ASan+UBSan or TSan),
// and how much longer its waits must be: the daemon and the CPU kernels run 5–20× slower there, so a
// test that waits for a layer to finish or for memory to come back scales its deadlines by
// kSanitizerSlowdown instead of failing on time.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVPACK_SANITIZER_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVPACK_SANITIZER_BUILD 1
#endif
#endif

namespace kvpack::testing {

#ifdef KVPACK_SANITIZER_BUILD
inline constexpr bool kSanitizerBuild = true;
inline constexpr int kSanitizerSlowdown = 10;
#else
inline constexpr bool kSanitizerBuild = false;
inline constexpr int kSanitizerSlowdown = 1;
#endif

}  // namespace kvpack::testing
